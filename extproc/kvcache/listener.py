"""KV events from engines that connect to the sidecar (llm-d's topology): one SUB socket bound
per data-parallel rank, each batch attributed to its engine by its topic.

vLLM connects its PUB socket, instead of binding it, when the endpoint names a host
(`tcp://gateway-epp:5557`); rank r of a data-parallel server connects to that port plus r.
llm-d's guides give every engine the topic `kv@<pod IP>@<model>`. So the listener binds
`host:port + r` for every rank r any engine has, and takes a batch on rank r's socket whose
topic names a pool member (by its IP, or its `ip:port` where engines share a host) as that
rank's. Anything else (a topic naming no member followed here, a message of the wrong shape) is
counted and dropped before it is decoded: a publisher that can reach the port cannot put an
engine of its own in the index. Nor, with `check_sender` (the default), speak for a member: a
batch counts only if its connection comes from the IP its topic names (ZMQ's Peer-Address).

Only one process can bind a port: where the sidecar runs several ext_proc processes
(`extproc.workers`), the main one binds and relays every batch it attributed, with its rank, over
a socket in the sidecar's private run directory; the others read that and attribute it again.

Each engine's batches go through a queue of `receive_hwm` messages to its own `EngineStream`
task (sequence, gaps, replay if configured, slices, its share of loop time), so one flooding
engine paces only itself. The receiving itself yields after every message, and what it drops
is paced by a budget of its own, so a flood of unknown topics neither holds the loop nor takes
it over.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
from collections.abc import Mapping
from dataclasses import dataclass

import zmq
import zmq.asyncio

from extproc.kvcache.index import KvIndex
from extproc.kvcache.stream import Budget, EngineStream, SubscriberLimits, supervised, zmq_socket
from extproc.metrics import Metrics
from extproc.stopping import cancel_and_wait

__all__ = ["EventListener", "Listened", "topic_who"]

log = logging.getLogger("extproc")

_TOPIC_PREFIX = "kv"
_MAX_TOPIC_BYTES = 512  # an IP and a model name; longer is no topic of ours


@dataclass(frozen=True, slots=True)
class Listened:
    """A pool member (or one rank of it) whose engine connects to the listener."""

    address: str  # the pool member, `ip:port`
    model: str = ""  # its model group; "" (the top-level pools): any model in the topic
    rank: int = 0
    replay_endpoint: str | None = None  # the engine's replay socket, where one is reachable


def topic_who(topic: bytes) -> tuple[str, str] | None:
    """`kv@<who>@<model>` → (who, model); None for any other topic."""
    if len(topic) > _MAX_TOPIC_BYTES:
        return None
    try:
        prefix, who, model = topic.decode().split("@", 2)
    except (UnicodeDecodeError, ValueError):
        return None
    return (who, model) if prefix == _TOPIC_PREFIX and who else None


def _same_ip(peer: str, address: str) -> bool:
    """Whether a connection from `peer` (ZMQ's Peer-Address) comes from the member at
    `address` (`ip:port`); an IPv4 peer seen on an IPv6 socket counts as itself."""
    try:
        ip = ipaddress.ip_address(peer)
        member = ipaddress.ip_address(_keys(address)[1])
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped == member
    return ip == member


def _serves(fed: _Fed, model: str) -> bool:
    return fed.source.model in ("", model)


def _keys(address: str) -> tuple[str, str]:
    """The names a topic may give a member: its `ip:port`, its IP (no brackets for IPv6)."""
    host = address.rpartition(":")[0]
    return address, host.removeprefix("[").removesuffix("]")


class _Fed:
    """One engine's stream, the queue the listener feeds it through and the task applying."""

    def __init__(self, source: Listened, stream: EngineStream, limits: SubscriberLimits) -> None:
        self.source = source
        self.stream = stream
        self.queue: asyncio.Queue[list[bytes]] = asyncio.Queue(limits.receive_hwm)
        self.task: asyncio.Task[None] | None = None

    async def run(self) -> None:
        while True:
            await self.stream.on_message(await self.queue.get())


class EventListener:
    """Binds `host:port + rank` and keeps the entries of the engines given (`set_engines`)
    current from what they send there."""

    def __init__(
        self,
        host: str,
        port: int,
        index: KvIndex,
        metrics: Metrics,
        *,
        limits: SubscriberLimits | None = None,
        context: zmq.asyncio.Context | None = None,
        listen: bool = True,
        relay: str | None = None,
        check_sender: bool = True,
    ) -> None:
        """`listen`: bind the engines' ports (else read what another process relays);
        `relay`: where the process that binds them passes on what it attributed, for the
        other ext_proc processes of the sidecar to read; `check_sender`: take a batch only
        from a connection whose IP is the member's its topic names."""
        self.host = host
        self._check_sender = check_sender
        self.port = port
        self._listen = listen
        self._relay_endpoint = relay
        self._relay: zmq.asyncio.Socket | None = None  # listen: the PUB the others read
        self._index = index
        self._metrics = metrics
        self._limits = limits or SubscriberLimits()
        self._context = context or zmq.asyncio.Context.instance()
        self._fed: dict[str, _Fed] = {}
        self._by_who: dict[tuple[str, int], list[str]] = {}  # (ip or ip:port, rank) → engines
        self._sockets: dict[int, tuple[zmq.asyncio.Socket, asyncio.Task[None]]] = {}
        self._refused: set[int] = set()  # ranks whose port could not be bound (logged once)
        self._dropped = Budget(
            self._limits.batches_per_s, self._limits.bytes_per_s, self._limits.loop_share
        )
        self.bound: dict[int, str] = {}  # rank → the endpoint bound (port 0: the port given)

    async def set_engines(self, engines: Mapping[str, Listened]) -> None:
        """Listen for exactly `engines` (engine → its member, model group and rank)."""
        for engine, fed in list(self._fed.items()):
            if engines.get(engine) != fed.source:
                await cancel_and_wait([fed.task])
                del self._fed[engine]
        for engine, source in engines.items():
            if engine not in self._fed:
                self._fed[engine] = fed = _Fed(source, self._stream(engine, source), self._limits)
                fed.stream.start()
                fed.task = asyncio.create_task(
                    supervised(fed.stream, fed.run, self._metrics, self._limits),
                    name=f"kv-events {engine}",
                )
        self._by_who = {}
        for engine, source in engines.items():
            for key in _keys(source.address):
                self._by_who.setdefault((key, source.rank), []).append(engine)
        for rank in sorted({source.rank for source in engines.values()}):
            self._bind(rank)

    def _stream(self, engine: str, source: Listened) -> EngineStream:
        return EngineStream(
            engine,
            self._index,
            self._metrics,
            replay_endpoint=source.replay_endpoint,
            limits=self._limits,
            context=self._context,
        )

    def _bind(self, rank: int) -> None:
        if not self._listen:
            self._read_relay()
            return
        if rank in self._sockets or rank in self._refused:
            return
        if self._relay_endpoint is not None and self._relay is None:
            self._bind_relay(self._relay_endpoint)
        endpoint = f"tcp://{self._host()}:{self._rank_port(rank)}"
        sock = zmq_socket(self._context, zmq.SUB, self._limits, ipv6=":" in self.host)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as error:
            sock.close(linger=0)
            self._refused.add(rank)
            log.error(
                "KV events: cannot listen on %s for data-parallel rank %d (%s); engines that "
                "connect there are not indexed. Free the port or change kv_listener.port",
                endpoint,
                rank,
                error,
            )
            return
        self.bound[rank] = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        log.info(
            "KV events: listening on %s for engines that connect (data-parallel rank %d); "
            "only the engines may reach it",
            self.bound[rank],
            rank,
        )
        task = asyncio.create_task(self._receiving(sock, rank), name=f"kv-listener rank {rank}")
        self._sockets[rank] = (sock, task)

    def _bind_relay(self, endpoint: str) -> None:
        relay = self._context.socket(zmq.PUB)
        relay.setsockopt(zmq.SNDHWM, self._limits.receive_hwm)
        relay.setsockopt(zmq.LINGER, 0)
        try:
            relay.bind(endpoint)
        except zmq.ZMQError as error:
            relay.close(linger=0)
            self._relay_endpoint = None  # logged once; this process still indexes the engines
            log.error(
                "KV events: cannot relay to the other ext_proc processes on %s (%s); they "
                "route those engines without their events",
                endpoint,
                error,
            )
            return
        self._relay = relay

    def _read_relay(self) -> None:
        """Another process binds the engines' ports: read what it relays (`(rank, topic,
        seq, batch)`), attributed here again."""
        if self._relay_endpoint is None or -1 in self._sockets:
            return
        sock = zmq_socket(self._context, zmq.SUB, self._limits)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(self._relay_endpoint)
        self._sockets[-1] = (
            sock,
            asyncio.create_task(self._receiving(sock, None), name="kv-relay"),
        )

    def _rank_port(self, rank: int) -> int:
        """Rank `rank`'s port: vLLM's rank r connects to the port plus r (with port 0, the
        port rank 0 was given plus r; rank 0's own is 0, the system's choice)."""
        base = self.port or int(self.bound.get(0, ":0").rpartition(":")[2])
        return base + rank

    def _host(self) -> str:
        return f"[{self.host}]" if ":" in self.host else self.host

    async def _receiving(self, sock: zmq.asyncio.Socket, rank: int | None) -> None:
        """`_receive`, restarted after a backoff should it ever fail (a bug, a library's
        surprise): the engines' streams keep their entries, and a lost message is a gap."""
        backoff = self._limits.restart_backoff_s
        while True:
            try:
                await self._receive(sock, rank)
            except Exception as exc:
                name = "relay" if rank is None else f"rank {rank}"
                self._metrics.kv_event_subscriber_restarts.labels(f"listener {name}").inc()
                log.error(
                    "KV events: the listener's %s receiver failed (%s: %.200s); restarting in %g s",
                    name,
                    type(exc).__name__,
                    exc,
                    backoff,
                )
            await asyncio.sleep(backoff)
            backoff = min(2 * backoff, self._limits.max_restart_backoff_s)

    async def _receive(self, sock: zmq.asyncio.Socket, rank: int | None) -> None:
        """`rank`: the socket's; None for the relay, whose first frame says it."""
        while True:
            if not await sock.poll(timeout=int(self._limits.poll_s * 1000)):
                continue
            if rank is None:  # the relay: the listening process checked its senders
                frames, peer = await sock.recv_multipart(), None
                frames_rank = int.from_bytes(frames.pop(0), "big") if len(frames) == 4 else 0
            else:
                frames, peer = await self._recv_with_peer(sock)
                frames_rank = rank
            engine = self._engine_of(frames, frames_rank)
            if engine is not None and peer is not None and not self._sent_by(engine, peer):
                engine = None
            fed = None if engine is None else self._fed.get(engine)
            if fed is None:
                await self._dropped.spend(sum(len(frame) for frame in frames))
                continue
            with contextlib.suppress(asyncio.QueueFull):  # its stream is paced: overflow is a gap
                fed.queue.put_nowait(frames)
            if self._relay is not None:  # past its queue a reader sees a gap, as here
                with contextlib.suppress(zmq.Again):
                    await self._relay.send_multipart(
                        [frames_rank.to_bytes(2, "big"), *frames], flags=zmq.NOBLOCK
                    )
            await asyncio.sleep(0)  # a flood still lets the request path run

    async def _recv_with_peer(self, sock: zmq.asyncio.Socket) -> tuple[list[bytes], str | None]:
        """A message and the IP of the connection it came on (None unless checked)."""
        if not self._check_sender:
            return await sock.recv_multipart(), None
        parts = await sock.recv_multipart(copy=False)
        return [part.bytes for part in parts], str(parts[0].get("Peer-Address"))

    def _sent_by(self, engine: str, peer: str) -> bool:
        """Whether `peer` is the IP of the engine the topic named (counted if not)."""
        fed = self._fed.get(engine)
        if fed is None or _same_ip(peer, fed.source.address):
            return True
        self._metrics.kv_event_unattributed.labels("wrong_sender").inc()
        return False

    def _engine_of(self, frames: list[bytes], rank: int) -> str | None:
        """The engine a message came from, or None (counted): a topic that names no engine
        followed here, several, or a message that is no batch."""
        if len(frames) != 3:
            self._metrics.kv_event_unattributed.labels("malformed").inc()
            return None
        who = topic_who(frames[0])
        if who is None:
            self._metrics.kv_event_unattributed.labels("unknown_topic").inc()
            return None
        engines = self._by_who.get((who[0], rank), [])
        if len(engines) > 1:  # members of several model groups on one IP: the model says
            # (`set_engines` may be part way: an engine of `_by_who` already gone from `_fed`)
            engines = [e for e in engines if (fed := self._fed.get(e)) and _serves(fed, who[1])]
        if len(engines) != 1:
            reason = "ambiguous_topic" if engines else "unknown_topic"
            self._metrics.kv_event_unattributed.labels(reason).inc()
            return None
        return engines[0]

    async def stop(self) -> None:
        await self.set_engines({})
        for sock, task in self._sockets.values():
            await cancel_and_wait([task])
            sock.close(linger=0)
        self._sockets.clear()
        if self._relay is not None:
            self._relay.close(linger=0)
            self._relay = None
        self.bound.clear()
        self._refused.clear()
