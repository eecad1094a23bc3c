"""A KV event subscriber for the vllmsim tests: real ZMQ sockets on 127.0.0.1."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import msgpack
import zmq

# "tcp://*:0" with VLLM_HOST_IP=127.0.0.1 binds an ephemeral loopback port, as vLLM does.
LOOPBACK_ENV = {"VLLM_HOST_IP": "127.0.0.1"}


def events_flag(topic: str = "kv", **extra: Any) -> tuple[str, str]:
    cfg = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": "tcp://*:0",
        "replay_endpoint": "tcp://127.0.0.1:0",
        "topic": topic,
        **extra,
    }
    return "--kv-events-config", json.dumps(cfg)


class Subscriber:
    def __init__(self, ctx: zmq.Context[Any], endpoint: str, topic: str = "kv") -> None:
        self.sock = ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self.sock.connect(endpoint)

    def next(self, timeout: float = 5.0) -> tuple[bytes, int, list[Any]] | None:
        """(topic, sequence number, decoded batch), or None after `timeout` seconds."""
        if not self.sock.poll(int(timeout * 1000)):
            return None
        topic, seq, payload = self.sock.recv_multipart()
        return topic, int.from_bytes(seq, "big"), msgpack.unpackb(payload)


@contextmanager
def subscriber(endpoint: str, topic: str = "kv") -> Iterator[Subscriber]:
    ctx: zmq.Context[Any] = zmq.Context()
    sub = Subscriber(ctx, endpoint, topic)
    try:
        yield sub
    finally:
        sub.sock.close(linger=0)
        ctx.term()


def replay(endpoint: str, start: int, timeout: float = 5.0) -> list[tuple[bytes, int, bytes]]:
    """Ask the replay socket for every batch from `start`; up to and without the end marker."""
    ctx: zmq.Context[Any] = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(endpoint)
    try:
        sock.send_multipart([b"", start.to_bytes(8, "big")])
        got: list[tuple[bytes, int, bytes]] = []
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            assert left > 0 and sock.poll(int(left * 1000)), "no end marker from the replay"
            empty, topic, seq, payload = sock.recv_multipart()
            assert empty == b""
            number = int.from_bytes(seq, "big", signed=True)
            if number == -1:
                assert topic == b"" and payload == b""
                return got
            got.append((topic, number, payload))
    finally:
        sock.close(linger=0)
        ctx.term()


def events_of(batch: list[Any], kind: str) -> list[dict[str, Any]]:
    return [e for e in batch[1] if e["type"] == kind]
