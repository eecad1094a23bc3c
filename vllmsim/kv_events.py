"""KV cache events as vLLM's `--kv-events-config` publishes them.

Each engine step that stored or evicted blocks publishes one batch on a ZMQ PUB socket as
three frames: the topic, an 8-byte big-endian sequence number (from 0 at each engine start)
and the payload, a msgpack `KVEventBatch`: the array [ts, events, data_parallel_rank], each
event a map tagged by "type" with vLLM's field order and its defaults left out.
The optional replay socket (ROUTER) answers a start sequence number with every buffered
batch from there on, then an end marker (an empty topic, sequence -1, an empty payload).

Endpoints follow vLLM: a PUB endpoint with "*" or "::" (or ipc/inproc) is bound, any other is
connected to (the subscriber binds); the replay endpoint is always bound; "tcp://*:0" binds
an ephemeral port on this node's IP (VLLM_HOST_IP). With data parallelism every rank publishes
on its own sockets, as vLLM's per-rank schedulers do: both endpoints' ports plus the rank, an
inproc name with `_dp<rank>` appended (an ipc one is refused), and the rank in every batch.
Simulator-only: a bound endpoint of port 0 with data parallelism gives rank 0 a free port and
rank r the port r after it (`rank_publishers` tries other ports while one is taken), so that a
subscriber finds each rank at the reported port plus the rank, as with fixed ports.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import time
from collections import deque
from dataclasses import dataclass, fields, replace
from itertools import count
from typing import Any

log = logging.getLogger(__name__)

MEDIUM_GPU = "GPU"
END_SEQ = (-1).to_bytes(8, "big", signed=True)


@dataclass(frozen=True)
class BlockStored:
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    session_id: str | None = None  # the request's (vLLM 0.32: its session_id, as sent)
    lora_id: int | None = None
    lora_name: str | None = None
    # Per block, the extra keys its hash covers (adapter, then the salt on a first block);
    # None when no block has any.
    extra_keys: list[tuple[str, ...] | None] | None = None

    def as_wire(self) -> dict[str, Any]:
        # vLLM's fields in order; lora_id..lora_name have no default (always sent), the later
        # ones are left out at their default (None) except group_idx, which vLLM sets.
        wire: dict[str, Any] = {
            "type": "BlockStored",
            "block_hashes": self.block_hashes,
            "parent_block_hash": self.parent_block_hash,
            "token_ids": self.token_ids,
            "block_size": self.block_size,
            "lora_id": self.lora_id,
            "medium": MEDIUM_GPU,
            "lora_name": self.lora_name,
        }
        if self.extra_keys is not None:
            wire["extra_keys"] = self.extra_keys
        wire["group_idx"] = 0
        if self.session_id is not None:
            wire["session_id"] = self.session_id
        return wire


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: list[int]

    def as_wire(self) -> dict[str, Any]:
        return {
            "type": "BlockRemoved",
            "block_hashes": self.block_hashes,
            "medium": MEDIUM_GPU,
            "group_idx": 0,
        }


@dataclass(frozen=True)
class AllBlocksCleared:
    def as_wire(self) -> dict[str, Any]:
        return {"type": "AllBlocksCleared"}


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's KVEventsConfig (the JSON of --kv-events-config)."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None  # "zmq" when events are enabled, else "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    @property
    def enabled(self) -> bool:
        kind = self.publisher or ("zmq" if self.enable_kv_cache_events else "null")
        return self.enable_kv_cache_events and kind == "zmq"


def parse_config(text: str) -> KVEventsConfig:
    """The flag's JSON; ValueError names what is wrong."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--kv-events-config is not valid JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise ValueError("--kv-events-config must be a JSON object")
    known = {f.name: f for f in fields(KVEventsConfig)}
    if unknown := sorted(set(raw) - set(known)):
        raise ValueError(
            f"--kv-events-config: unknown key(s) {', '.join(unknown)} (known: {', '.join(known)})"
        )
    if raw.get("publisher") not in (None, "null", "zmq"):
        raise ValueError("--kv-events-config: publisher must be 'zmq' or 'null'")
    for key in ("buffer_steps", "hwm", "max_queue_size"):
        if key in raw and (not isinstance(raw[key], int) or raw[key] < 0):
            raise ValueError(f"--kv-events-config: {key} must be a non-negative integer")
    for key in ("endpoint", "topic"):
        if key in raw and not isinstance(raw[key], str):
            raise ValueError(f"--kv-events-config: {key} must be a string")
    cfg = KVEventsConfig(**raw)
    if cfg.enabled and not cfg.endpoint.startswith(("tcp://", "ipc://", "inproc://")):
        raise ValueError("--kv-events-config: endpoint must be tcp://, ipc:// or inproc://")
    return cfg


def encode_batch(ts: float, events: list[KVEvent], dp_rank: int = 0) -> bytes:
    import msgpack

    return bytes(msgpack.packb([ts, [e.as_wire() for e in events], dp_rank]))


def rank_endpoint(endpoint: str, rank: int) -> str:
    """Rank `rank`'s endpoint of a data-parallel server (vLLM's port offset)."""
    if rank == 0:
        return endpoint
    if "inproc" in endpoint:
        return f"{endpoint}_dp{rank}"
    if "tcp" not in endpoint:  # vLLM refuses an ipc endpoint with data parallelism too
        raise ValueError("with --data-parallel-size the endpoint must be tcp:// or inproc://")
    base, colon, port = endpoint.rpartition(":")
    if not colon or not port.isdigit() or int(port) == 0:
        return endpoint
    return f"{base}:{int(port) + rank}"


def _node_ip() -> str:
    """This node's IP as vLLM finds it: VLLM_HOST_IP, else the route to a public address."""
    if ip := os.environ.get("VLLM_HOST_IP"):
        return ip
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("8.8.8.8", 80))  # no packet is sent: this only picks the route
        return str(s.getsockname()[0])
    raise ValueError("tcp://*:0 needs a node IP; set VLLM_HOST_IP")


def _bind(sock: Any, endpoint: str) -> str:
    """Bind; returns the endpoint actually bound (the port of a port-0 endpoint).

    Simulator-only: with VLLM_HOST_IP set, `tcp://*:<port>` binds that IP alone (vLLM binds
    every interface), so that tests keep their fixed ports on the loopback."""
    import zmq

    if endpoint == "tcp://*:0":
        endpoint = f"tcp://{_node_ip()}:0"
    elif endpoint.startswith("tcp://*:") and (ip := os.environ.get("VLLM_HOST_IP")):
        endpoint = f"tcp://{ip}:{endpoint.removeprefix('tcp://*:')}"
    sock.bind(endpoint)
    last = sock.getsockopt(zmq.LAST_ENDPOINT)
    return last.decode() if isinstance(last, bytes) else str(last)


class KVEventsSocketError(Exception):
    """A KV events endpoint cannot be bound or connected to."""


class EventPublisher:
    """One engine's PUB socket, replay buffer and replay server. The sockets outlive a
    simulated restart (a restarted vLLM binds the same ports); `restart` starts the sequence
    again from 0 with an empty buffer, as a new vLLM process does."""

    def __init__(self, cfg: KVEventsConfig, rank: int = 0) -> None:
        import zmq
        import zmq.asyncio

        self.cfg = cfg
        self.rank = rank  # the data-parallel rank: its ports' offset, and in every batch
        self._ctx = zmq.asyncio.Context()  # the replay socket awaits requests on the loop
        self._pub_ctx = zmq.Context()  # PUB sends without blocking: a plain socket will do
        self._pub = self._pub_ctx.socket(zmq.PUB)
        self._pub.set_hwm(cfg.hwm)
        self._replay: Any = None
        self.replay_endpoint: str | None = None
        ep = cfg.endpoint
        try:
            ep = rank_endpoint(ep, rank)
            if "*" in ep or "::" in ep or ep.startswith(("ipc://", "inproc://")):
                self.endpoint = _bind(self._pub, ep)
            else:
                self._pub.connect(ep)
                self.endpoint = ep
            if cfg.replay_endpoint:
                ep = rank_endpoint(cfg.replay_endpoint, rank)
                self._replay = self._ctx.socket(zmq.ROUTER)
                self.replay_endpoint = _bind(self._replay, ep)
        except (zmq.ZMQError, ValueError) as exc:
            self._close_sockets()
            raise KVEventsSocketError(f"KV events endpoint {ep}: {exc}") from exc
        self._topic = cfg.topic.encode()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=max(1, cfg.buffer_steps))
        self._seq = count()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._replay is not None:
            self._task = asyncio.get_running_loop().create_task(self._serve_replay())

    def restart(self) -> None:
        self._seq = count()
        self._buffer.clear()

    def publish(self, events: list[KVEvent]) -> None:
        """One step's events as one batch. PUB never blocks: past the HWM ZMQ drops."""
        import zmq

        if not events:
            return
        seq = next(self._seq)
        payload = encode_batch(time.time(), events, self.rank)
        with contextlib.suppress(zmq.Again):
            self._pub.send_multipart(
                [self._topic, seq.to_bytes(8, "big"), payload], flags=zmq.NOBLOCK
            )
        self._buffer.append((seq, payload))

    async def _serve_replay(self) -> None:
        assert self._replay is not None
        while True:
            frames = await self._replay.recv_multipart()
            if len(frames) != 3:
                log.warning("invalid KV event replay request: %d frames", len(frames))
                continue
            client, _, start = frames
            first = int.from_bytes(start, "big")
            for seq, payload in list(self._buffer):
                if seq >= first:
                    await self._replay.send_multipart(
                        [client, b"", self._topic, seq.to_bytes(8, "big"), payload]
                    )
            await self._replay.send_multipart([client, b"", b"", END_SEQ, b""])

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._close_sockets()

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()
        self._pub_ctx.term()


BIND_ATTEMPTS = 50  # free ports tried for rank 0 of a port-0 data-parallel publisher


async def rank_publishers(cfg: KVEventsConfig, ranks: int) -> list[EventPublisher]:
    """One publisher per data-parallel rank, rank r's ports r after rank 0's. Where a bound
    endpoint's port is 0, rank 0 takes a free one and the other ranks the ports after it;
    when one of those is taken, every socket is closed and another free port tried."""
    if ranks == 1 or not (_bound_any_port(cfg.endpoint) or _bound_any_port(cfg.replay_endpoint)):
        return [EventPublisher(cfg, rank) for rank in range(ranks)]
    for _ in range(BIND_ATTEMPTS):
        first = EventPublisher(cfg, 0)
        fixed = replace(
            cfg,
            endpoint=_port_of(cfg.endpoint, first.endpoint),
            replay_endpoint=cfg.replay_endpoint
            and _port_of(cfg.replay_endpoint, first.replay_endpoint or ""),
        )
        publishers = [first]
        try:
            publishers += [EventPublisher(fixed, rank) for rank in range(1, ranks)]
        except KVEventsSocketError:
            for publisher in publishers:
                await publisher.close()
            continue
        return publishers
    raise KVEventsSocketError(
        f"KV events endpoint {cfg.endpoint}: no {ranks} consecutive free ports"
    )


def _bound_any_port(endpoint: str | None) -> bool:
    return bool(endpoint) and str(endpoint).startswith("tcp://") and str(endpoint).endswith(":0")


def _port_of(endpoint: str, bound: str) -> str:
    """`endpoint` with the port `bound` got, where it asked for any (port 0)."""
    if not _bound_any_port(endpoint):
        return endpoint
    return f"{endpoint.removesuffix(':0')}:{bound.rpartition(':')[2]}"
