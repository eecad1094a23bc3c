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


class Fifo:
    """A resource that does one thing at a time, in order of arrival: a NIC's bytes, the API
    server's tokenizer thread. It only keeps the books; the caller sleeps."""

    def __init__(self) -> None:
        self._free_at = 0.0  # when the work already taken on is done

    def take(self, seconds: float, now: float) -> float:
        """Seconds from `now` until `seconds` of work taken on now is done."""
        self._free_at = max(now, self._free_at) + seconds
        return self._free_at - now


class ApiProcess:
    """vLLM's API server process, shared by the engine ranks behind it. Its one asyncio event
    loop (`loop`) takes in every request (parse, input processing, hand-off to the engine core)
    and detokenizes and streams every output token of every running request, one thing at a
    time: a request arriving at a busy server waits behind that work. Its renderer tokenizes
    prompts on `renderer_num_workers` threads, one by default (`tokenizer`)."""

    def __init__(self) -> None:
        self.loop = Fifo()
        self.tokenizer = Fifo()


class Link:
    """One engine's NIC: the bytes of its transfers cross it one after another, at the link's
    bandwidth (a transfer posted while others are in flight waits for their bytes), each
    transfer then paying the wire's latency once."""

    def __init__(self) -> None:
        self._bytes = Fifo()

    def transfer(self, cost: CostModel, num_blocks: int, now: float) -> float:
        """Seconds from `now` until a transfer of `num_blocks` posted now completes."""
        crossing = num_blocks * cost.block_bytes / (cost.kv_bandwidth_gbps * 1e9)
        return self._bytes.take(crossing, now) + cost.kv_message_latency_ms / 1000.0


def message_seconds(cost: CostModel) -> float:
    """One-way latency of a side-channel message (handshake, PUSH_REG, notif)."""
    return cost.kv_message_latency_ms / 1000.0


def blocks_for(num_tokens: int, block_size: int = BLOCK_SIZE) -> int:
    return max(1, math.ceil(num_tokens / block_size))
