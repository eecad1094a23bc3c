"""KV event batches written as vLLM's msgspec encoder writes them (maps tagged by `type`), and
a publisher that sends them as vLLM's ZmqEventPublisher does, for the kvcache tests."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from extproc.kvcache.subscriber import EngineEvents
from extproc.stopping import cancel_and_wait

BLOCK = 4


def stored(hashes: list[Any], parent: Any, tokens: list[int], **extra: Any) -> dict[str, Any]:
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": BLOCK,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        **extra,
    }


def removed(hashes: list[Any]) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU"}


def cleared() -> dict[str, Any]:
    return {"type": "AllBlocksCleared"}


def batch(*events: Any, ts: float = 1.0) -> bytes:
    return msgpack.packb([ts, list(events), 0])


def chain(first_hash: int, tokens: list[int], parent: Any = None) -> dict[str, Any]:
    """One BlockStored of consecutive blocks hashed first_hash, first_hash + 1, ..."""
    n = len(tokens) // BLOCK
    return stored(list(range(first_hash, first_hash + n)), parent, tokens)


END = (-1).to_bytes(8, "big", signed=True)


class FakeEngine:
    """A publisher as vLLM's ZmqEventPublisher: PUB plus a ROUTER replaying its kept batches."""

    def __init__(self, ctx: zmq.asyncio.Context, keep: int = 100, host: str = "127.0.0.1") -> None:
        self.pub = ctx.socket(zmq.PUB)
        self.router = ctx.socket(zmq.ROUTER)
        for sock in (self.pub, self.router):
            sock.setsockopt(zmq.IPV6, int(":" in host))
            sock.bind(f"tcp://{f'[{host}]' if ':' in host else host}:*")
        self.endpoint = self.pub.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.replay_endpoint = self.router.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.kept: list[tuple[int, bytes]] = []
        self.keep = keep
        self.seq = 0
        self.replays: list[int] = []
        self.answer_replays = True
        self._server = asyncio.create_task(self._serve_replays())

    async def send(self, payload: bytes, *, lost: bool = False) -> int:
        """Publish the next batch (or, `lost`, only keep it for replay: the PUB lost it)."""
        seq, self.seq = self.seq, self.seq + 1
        self.kept = [*self.kept, (seq, payload)][-self.keep :]
        if not lost:
            await self.pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])
        return seq

    async def _serve_replays(self) -> None:
        while True:
            client, _, start = await self.router.recv_multipart()
            self.replays.append(int.from_bytes(start, "big"))
            if not self.answer_replays:
                continue
            for seq, payload in self.kept:
                if seq >= int.from_bytes(start, "big"):
                    await self.router.send_multipart(
                        [client, b"", b"", seq.to_bytes(8, "big"), payload]
                    )
            await self.router.send_multipart([client, b"", b"", END, b""])

    async def close(self) -> None:
        await cancel_and_wait([self._server])
        self.pub.close(linger=0)
        self.router.close(linger=0)


async def joined(engine: FakeEngine, events: EngineEvents) -> None:
    """Publish empty batches until the subscriber has one (a SUB joins a PUB late)."""
    async with asyncio.timeout(10):
        while not events.applied.is_set():
            await engine.send(batch())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(events.applied.wait(), 0.05)
