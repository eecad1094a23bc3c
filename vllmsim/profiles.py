"""Named cost-model profiles: a handful of physical parameters, each with where it comes from.

`gpu-8b`    an 8B-class model (Llama-3-8B shapes) on one GPU per engine with one NIC, the setup
            of vllm-project/router PR #187's push benchmark (4P4D, input 1024 / output 64). It
            is the default. Its step, prefill, API and NIXL values are fitted to the PR's rows
            (bench/fit.py on a virtual clock, now the lab's: PR #187's plan in bench/pr187.py,
            within the ranges commented there), each within what the hardware allows;
            bench/calibrate.py checks the fit.
`cpu-tiny`  the tiny random-weight Llama (hidden 128, 2 layers, 2 KV heads of 32 dims) served
            by real vLLM 0.32 on one core of this project's 2-core CPU machine, NIXL over
            loopback (scripts/real_vllm.py). Fitted to the engine metrics of the real run
            that bench/results/calibration.md compares with.

`vllmsim --profile NAME` starts from a profile; any cost flag given as well overrides it.
"""

from __future__ import annotations

from vllmsim.config import CostModel

GPU_8B = CostModel(
    # Fitted (range 5-20 ms). A decode step reads ~16 GB of bf16 weights, 5 ms at ~3.3 TB/s,
    # plus scheduling, input preparation and kernel launches.
    step_base_ms=11.0,
    # Fitted (range 0.015-0.07). 2 x 8e9 FLOPs per token in 0.039 ms is ~410 TFLOPS, 41 % of
    # an H100's dense bf16 peak: a 1024-token prompt alone takes 11 + 40 = 51 ms.
    prefill_per_token_ms=0.039,
    # Fitted (range 0-0.3): each running sequence's KV reads (~128 KiB per token) in a step.
    decode_per_seq_ms=0.018,
    # Fitted (range 0.3-3): a step with nothing to run, scheduler pass plus the connector's
    # get_finished, no forward.
    idle_step_ms=1.5,
    # Fitted (range 0.5-15): the request path beside the API server's loop and tokenizer
    # thread (IPC to the engine core, its input thread, the router), one request alone. What
    # that covers physically is small; the fit keeps it near 14 ms because the PR's C = 8 row
    # wants a long serial path (docs/simulator.md, calibration). (vllm-project/router PR #207
    # measured D-side "HTTP parsing, tokenization and admission" at ~32 ms p50 on a loaded
    # 3P1D H100 setup.)
    api_overhead_ms=13.7,
    # Fitted (range 0.3-5) on the API server's one event loop: a request's intake (HTTP parse
    # and validation of a 1024-token prompt, input processing, the hand-off to the engine
    # core), ~1-2 ms of Python. It waits behind what the loop streams.
    api_intake_ms=1.4,
    # Fitted (range 0.02-1) on the same loop: one output token's incremental detokenization
    # and its SSE chunk (the response object, its JSON, the write), ~0.1 ms of Python: a D
    # streaming 8 requests (C = 32) spends 1 ms of each ~12 ms step on it.
    stream_per_token_ms=0.125,
    # A fast tokenizer's ~1 M tokens/s on the API server's one tokenizer thread (vLLM's
    # renderer_num_workers defaults to 1), one prompt after another. Not fitted: a search
    # (range 0.0005-0.01) found 0.0022 with a larger error, as a 1 ms stagger of a burst
    # decides which prompts share P's next step; the search with the API loop left it at
    # 0.00096.
    tokenize_per_token_ms=0.001,
    # The fit's choice between vLLM's two GPU defaults for `vllm serve`: 2048 tokens and 256
    # sequences on every GPU but the >= 70 GiB non-A100 class (H100/H200: 8192 and 1024;
    # EngineArgs._set_default_args in vllm/engine/arg_utils.py). The PR names no GPU; with 8192
    # the fit's error is 4 x larger: a burst of 8 prompts per P (C = 32) then waits for one
    # 8192-token step, where the PR's TTFT grows far less from C = 8 to 32.
    max_num_batched_tokens=2048,
    max_num_seqs=256,
    max_model_len=8192,
    num_gpu_blocks=8192,  # ~16 GiB of KV cache at 2 MiB per block
    # Llama-3-8B: 32 layers x K,V x 8 KV heads x 128 dims x 2 bytes x 16 tokens = 2 MiB.
    block_bytes=2 * 1024 * 1024,
    # Fitted (range 10-50 GB/s, at its low end): ~80 Gb/s per engine, shared by its transfers.
    kv_bandwidth_gbps=10.0,
    # Fitted (range 0.02-1 ms): one NIXL notif or side-channel message between hosts.
    kv_message_latency_ms=0.14,
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
    tokenize_per_token_ms=0.0,  # measured as part of api_overhead_ms above
    # Not separated from api_overhead_ms either: the real run's API servers streamed at most
    # four requests, and the fit above is to their means.
    api_intake_ms=0.0,
    stream_per_token_ms=0.0,
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
