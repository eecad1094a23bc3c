"""Pure step-time and transfer-time model; it never sleeps (the engine does)."""

from __future__ import annotations

import math

from vllmsim.config import BLOCK_SIZE, CostModel


def step_seconds(cost: CostModel, prefill_tokens: int, decode_seqs: int) -> float:
    """Duration of one engine step that batches chunked prefill and decode."""
    ms = cost.step_base_ms
    ms += cost.prefill_per_token_ms * prefill_tokens
    ms += cost.decode_per_seq_ms * decode_seqs
    return ms / 1000.0


def transfer_seconds(cost: CostModel, num_blocks: int) -> float:
    """Time for one NIXL READ/WRITE of `num_blocks` blocks: latency + bytes / bandwidth."""
    nbytes = num_blocks * cost.block_bytes
    return cost.kv_message_latency_ms / 1000.0 + nbytes / (cost.kv_bandwidth_gbps * 1e9)


def message_seconds(cost: CostModel) -> float:
    """One-way latency of a side-channel message (handshake, PUSH_REG, notif)."""
    return cost.kv_message_latency_ms / 1000.0


def blocks_for(num_tokens: int, block_size: int = BLOCK_SIZE) -> int:
    return max(1, math.ceil(num_tokens / block_size))
