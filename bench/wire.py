"""Dispatch skew on the wire: kernel timestamps of the requests that reach the engines' ports.

The engines' own arrival clocks include their scheduling (P and D share one CPU, so one of them
waits for the other); the first TCP segment of a request, stamped by the kernel as it crosses
loopback, is where the proxy actually let that leg go. The capture needs root (an AF_PACKET
socket) and runs as its own process, so parsing packets never competes with the client.

    python bench/wire.py PORT[,PORT...] OUT   # until SIGTERM; OUT: "<ts> <port> <x-request-id>"
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import struct
import sys
from collections.abc import AsyncIterator, Iterable
from pathlib import Path

from extproc.process.subprocesses import terminate

_ETH_P_IP = 0x0800
_SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)
_PACKET_OUTGOING = 4  # loopback shows each packet twice: keep the incoming copy
_ID_HEADER = b"\r\nx-request-id:"

Record = tuple[float, int, str]  # (kernel time, destination port, x-request-id)


def parse(packet: bytes, ports: set[int]) -> tuple[int, str] | None:
    """(port, request id) if `packet` is IPv4/TCP to one of `ports` starting an HTTP POST."""
    if len(packet) < 40 or packet[9] != socket.IPPROTO_TCP:
        return None
    ihl = (packet[0] & 0x0F) * 4
    port = struct.unpack_from("!H", packet, ihl + 2)[0]
    if port not in ports:
        return None
    payload = packet[ihl + (packet[ihl + 12] >> 4) * 4 :]
    if not payload.startswith(b"POST "):
        return None
    head = payload.split(b"\r\n\r\n", 1)[0].lower()
    start = head.find(_ID_HEADER)
    if start < 0:
        return None
    end = head.find(b"\r\n", start + len(_ID_HEADER))
    value = head[start + len(_ID_HEADER) : end if end >= 0 else None]
    return port, value.strip().decode(errors="replace")


def capture(ports: set[int], out: Path) -> None:
    sock = socket.socket(socket.AF_PACKET, socket.SOCK_DGRAM, socket.htons(_ETH_P_IP))
    sock.bind(("lo", 0))
    sock.setsockopt(socket.SOL_SOCKET, _SO_TIMESTAMPNS, 1)
    stop = False

    def on_term(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    sock.settimeout(0.2)  # to notice SIGTERM
    with out.open("w") as sink:
        print("ready", file=sys.stderr, flush=True)
        while not stop:
            try:
                packet, ancillary, _, address = sock.recvmsg(65536, 64)
            except (TimeoutError, InterruptedError):
                continue
            if address[2] == _PACKET_OUTGOING:
                continue
            found = parse(packet, ports)
            if found is None:
                continue
            seconds, nanos = next(
                struct.unpack("qq", data[:16])
                for level, kind, data in ancillary
                if level == socket.SOL_SOCKET and kind == _SO_TIMESTAMPNS
            )
            sink.write(f"{seconds + nanos / 1e9:.9f} {found[0]} {found[1]}\n")


@contextlib.asynccontextmanager
async def wire_capture(ports: Iterable[int]) -> AsyncIterator[list[Record]]:
    """Capture while the block runs; the yielded list holds the records once it has ended.

    Without root the list stays empty (and a line says why)."""
    records: list[Record] = []
    if os.geteuid() != 0:
        print("wire capture skipped: needs root (an AF_PACKET socket)", flush=True)
        yield records
        return
    out = Path(f"/tmp/pd-extproc-wire-{os.getpid()}.txt")
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        __file__,
        ",".join(map(str, ports)),
        str(out),
        stderr=asyncio.subprocess.PIPE,
        start_new_session=True,
    )
    assert process.stderr is not None
    try:
        ready = await asyncio.wait_for(process.stderr.readline(), 10)
        if ready.strip() != b"ready":
            raise RuntimeError(f"wire capture did not start: {ready.decode(errors='replace')}")
        yield records
    finally:
        await terminate(process, 10)
        records += await asyncio.to_thread(_read_and_remove, out)


def _read_and_remove(path: Path) -> list[Record]:
    records: list[Record] = []
    if not path.exists():  # the capture never started
        return records
    for line in path.read_text().splitlines():
        ts, port, request_id = line.split(" ", 2)
        records.append((float(ts), int(port), request_id))
    path.unlink()
    return records


def leg_skews(
    records: list[Record], p_port: int, d_port: int, window: tuple[float, float]
) -> list[float]:
    """D − P (signed: > 0 when P left first) per request id seen on both ports inside
    `window`, from the first segment of each."""
    first: dict[tuple[int, str], float] = {}
    for ts, port, request_id in records:
        if window[0] <= ts <= window[1]:
            first.setdefault((port, request_id), ts)
    return [
        ts - first[(p_port, rid)]
        for (port, rid), ts in first.items()
        if port == d_port and (p_port, rid) in first
    ]


def dispatch_delays(
    records: list[Record], proxy_port: int, p_port: int, window: tuple[float, float]
) -> list[float]:
    """For one-at-a-time requests: from the client's request reaching the proxy's port to the
    proxy's P leg leaving for P (the next P request on the wire). Proxies may replace the
    request id, so the pairing is by order, not by id."""
    events = sorted(
        (ts, port)
        for ts, port, _ in records
        if window[0] <= ts <= window[1] and port in (proxy_port, p_port)
    )
    delays, arrived = [], None
    for ts, port in events:
        if port == proxy_port:
            arrived = ts
        elif arrived is not None:
            delays.append(ts - arrived)
            arrived = None
    return delays


if __name__ == "__main__":
    capture({int(p) for p in sys.argv[1].split(",")}, Path(sys.argv[2]))
