"""SimConfig: the only input of a simulated engine, built by cli.py.

Keeps `vllm serve`-shaped settings (model names, kv-transfer-config, side channel)
apart from the simulator's own knobs (cost model, faults).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllmsim.kv_events import KVEventsConfig

BLOCK_SIZE = 16  # tokens per KV block, vLLM's default on CUDA

PUSH_CONNECTORS = frozenset({"NixlPushConnector"})
PULL_CONNECTORS = frozenset({"NixlConnector", "NixlPullConnector"})
ROLES = frozenset({"kv_producer", "kv_consumer", "kv_both"})


@dataclass(frozen=True)
class CostModel:
    """Knobs of the step-time model; defaults are the `gpu-8b` profile (profiles.py says where
    each value comes from), but for the API server loop's costs, off unless a profile sets them.

    step = step_base + prefill_per_token x prefill tokens + decode_per_seq x decode seqs,
    so a 1024-token prompt alone takes ~51 ms and a decode step 11-16 ms.
    """

    step_base_ms: float = 11.0
    prefill_per_token_ms: float = 0.039
    decode_per_seq_ms: float = 0.018
    idle_step_ms: float = 1.5  # a step with nothing to compute (scheduler + connector only)
    api_overhead_ms: float = 13.7  # HTTP request -> scheduler queue (IPC), concurrent
    # The prompt's tokenization, on the API server's one tokenizer thread: requests that
    # arrive together are tokenized one after another.
    tokenize_per_token_ms: float = 0.001
    # The API server's one event loop (cost_model.ApiProcess): a request's intake (parse,
    # input processing, hand-off to the engine core) and each output token's detokenization
    # and streaming, one after another. Off unless a profile sets them.
    api_intake_ms: float = 0.0
    stream_per_token_ms: float = 0.0
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_model_len: int = 8192
    num_gpu_blocks: int = 8192
    # Llama-3-8B: 32 layers x K,V x 8 heads x 128 dims x 2 bytes x 16 tokens = 2 MiB.
    block_bytes: int = 2 * 1024 * 1024
    kv_bandwidth_gbps: float = 10.0  # GB/s, one engine's NIC (its transfers share it)
    kv_message_latency_ms: float = 0.14  # one-way, per side-channel message


@dataclass
class Faults:
    """Mutable fault plan; flipped at run time through POST /sim/faults."""

    fail_next: int = 0
    fail_status: int = 500
    hang_next: int = 0
    latency_ms: float = 0.0
    drop_registrations: bool = False
    refuse_connections: bool = False
    # Deliberately broken KV transfers served by this engine (P): the block ids are shifted
    # by `kv_block_offset`, and the last `kv_truncate_blocks` blocks are not sent.
    kv_block_offset: int = 0
    kv_truncate_blocks: int = 0

    def as_dict(self) -> dict[str, object]:
        return {
            "fail_next": self.fail_next,
            "fail_status": self.fail_status,
            "hang_next": self.hang_next,
            "latency_ms": self.latency_ms,
            "drop_registrations": self.drop_registrations,
            "refuse_connections": self.refuse_connections,
            "kv_block_offset": self.kv_block_offset,
            "kv_truncate_blocks": self.kv_truncate_blocks,
        }


@dataclass(frozen=True)
class KVTransferConfig:
    """The parts of vLLM's --kv-transfer-config the simulator understands."""

    connector: str
    role: str
    engine_id: str | None = None  # pinned id; otherwise a new uuid4 per (re)start
    lease_duration_s: float = 30.0  # kv_connector_extra_config.kv_lease_duration
    load_failure_policy: str = "fail"  # kv_load_failure_policy: fail | recompute
    # P's params name transfer_mode (vLLM 0.28 on); False: as older vLLM, pull-only (--pre-0-28)
    names_transfer_mode: bool = True

    @property
    def transfer_mode(self) -> str:
        return "push" if self.connector in PUSH_CONNECTORS else "pull"


@dataclass(frozen=True)
class SimConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_names: tuple[str, ...] = ("sim-model",)
    kv: KVTransferConfig | None = None
    side_channel_host: str = "localhost"
    side_channel_port: int = 5600
    tokenizer: str | None = None
    port_file: str | None = None
    cost: CostModel = field(default_factory=CostModel)
    faults: Faults = field(default_factory=Faults)
    api_keys: tuple[str, ...] = ()  # --api-key / VLLM_API_KEY: bearer tokens the API requires
    cache: CacheConfig = field(default_factory=lambda: CacheConfig())
    kv_events: KVEventsConfig | None = None  # --kv-events-config
    enable_prompt_tokens_details: bool = False  # usage.prompt_tokens_details.cached_tokens
    data_parallel_size: int = 1  # --data-parallel-size: engine ranks behind this API server
    dev_mode: bool = False  # VLLM_SERVER_DEV_MODE=1: the development routes (/reset_prefix_cache)
    lora_modules: tuple[str, ...] = ()  # --lora-modules: the adapters' names (ids 1, 2, ...)


@dataclass(frozen=True)
class CacheConfig:
    """vLLM's --block-size and --enable-prefix-caching (on by default in vLLM v1)."""

    block_size: int = BLOCK_SIZE
    enable_prefix_caching: bool = True
