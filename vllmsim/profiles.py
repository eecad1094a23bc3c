"""Named cost-model profiles: a handful of physical parameters, each with where it comes from.

`gpu-8b`    an 8B-class model (Llama-3-8B shapes) on one H100 per engine with an RDMA NIC, the
            setup of vllm-project/router PR #187's push benchmark (input 1024 / output 64).
            It is the default, and it is not fitted to any P/D measurement: calibration only
            checks it (bench/calibrate.py).
`cpu-tiny`  the tiny random-weight Llama (hidden 128, 2 layers, 2 KV heads of 32 dims) served
            by real vLLM 0.32 on one core of this project's 2-core CPU machine, NIXL over
            loopback (scripts/real_vllm.py). Fitted to the engine metrics of the real run
            that bench/results/calibration.md compares with.

`vllmsim --profile NAME` starts from a profile; any cost flag given as well overrides it.
"""

from __future__ import annotations

from vllmsim.config import CostModel

GPU_8B = CostModel(
    # Decode step of an 8B model at small batch on an H100: ~16 GB of bf16 weights read per step
    # at ~3 TB/s is 5-6 ms, plus scheduler and launch overhead.
    step_base_ms=5.0,
    # 2 x 8e9 FLOPs per token at ~30 % of the H100's ~990 dense bf16 TFLOPS (attention,
    # kernel launches and chunking included) is ~0.058 ms per token: a 1024-token prompt alone
    # takes ~70 ms, the simulator's long-standing default.
    prefill_per_token_ms=0.0425,
    # Each running sequence adds its KV reads (~0.13 MB per 1k tokens per layer) to a decode step.
    decode_per_seq_ms=0.02,
    # A step with nothing to run: scheduler pass plus the connector's get_finished, no forward.
    idle_step_ms=1.0,
    # HTTP parse, tokenization of 1024 tokens and IPC to the engine core. vllm-project/router
    # PR #207 measured D-side "HTTP parsing, tokenization and admission" at ~32 ms p50 on a
    # 3P1D H100 setup; admission is modelled by the scheduler here, so about a third of it.
    api_overhead_ms=9.4,
    # vLLM's defaults for `vllm serve` on a GPU of >= 70 GiB that is not an A100 (H100, H200):
    # EngineArgs._set_default_args in vllm/engine/arg_utils.py.
    max_num_batched_tokens=8192,
    max_num_seqs=1024,
    max_model_len=8192,
    num_gpu_blocks=8192,  # ~16 GiB of KV cache at 2 MiB per block
    # Llama-3-8B: 32 layers x K,V x 8 KV heads x 128 dims x 2 bytes x 16 tokens = 2 MiB.
    block_bytes=2 * 1024 * 1024,
    kv_bandwidth_gbps=17.0,  # one 200 Gb/s RDMA NIC
    kv_message_latency_ms=0.2,  # one NIXL notif or side-channel message between hosts
)

CPU_TINY = CostModel(
    # Fitted to the engines' own metrics in bench/results/calibration_real.json (means over
    # its four pair sessions; the machine was shared with other work, so these are the engines'
    # speeds under that load, about 3x slower than on a quiet machine).
    # D's vllm:inter_token_latency_seconds at c = 1-4: a decode step of the tiny model is
    # vLLM's per-step Python and inter-process cost, not compute.
    step_base_ms=17.9,
    # (P's vllm:request_prefill_time_seconds - one step) / prompt tokens: (46.8 - 17.9) / 350.
    prefill_per_token_ms=0.083,
    # The tiny model's per-sequence decode work is small next to the step's fixed cost.
    decode_per_seq_ms=0.2,
    # Assumed, not measured: one EngineCore-worker round trip with no forward.
    idle_step_ms=2.0,
    # P's vllm:time_to_first_token_seconds (taken by the API server) minus its
    # vllm:request_prefill_time_seconds: parse, tokenize, IPC to the engine core and back,
    # on the core the engine also runs on.
    api_overhead_ms=27.5,
    max_num_batched_tokens=2048,  # scripts/real_vllm.py starts vLLM with --max-model-len 2048
    max_num_seqs=256,
    max_model_len=2048,
    num_gpu_blocks=131_072,  # VLLM_CPU_KVCACHE_SPACE=1 GiB at 8 KiB per 16-token block
    # 2 layers x K,V x 2 KV heads x 32 dims x 2 bytes x 16 tokens.
    block_bytes=8192,
    # NIXL/UCX over loopback (cma): P's vllm:nixl_xfer_time_seconds (WRITE posted to its
    # completion notif) averages 5.7 ms for ~180 KB, nearly all of it fixed cost: split as two
    # messages of 2.5 ms, the bandwidth matters little.
    kv_bandwidth_gbps=1.0,
    kv_message_latency_ms=2.5,
)

PROFILES: dict[str, CostModel] = {"gpu-8b": GPU_8B, "cpu-tiny": CPU_TINY}
DEFAULT_PROFILE = "gpu-8b"
