"""Kubernetes discovery at scale: N pods join an InferencePool at once; how long until
`pd-extproc up` serves them all (its /ready and Envoy's clusters, over EDS), and the CPU its
processes (ext_proc and Envoy) spend meanwhile.

The fake Kubernetes API of the tests (tests/support/kube_api.py) runs in this process; the
pods' IPs (10.77.x.y) lead nowhere, so the health checks that follow fail, as they would for
engines still starting. Linux only (the CPU is read from /proc).

    python scripts/kube_scale.py [--pods 3000]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from extproc.testing import ephemeral_config, running_sidecar
from tests.support.kube_api import fake_kube_api, inference_pool, pod

ROLE = "llm-d.ai/role"
_TICKS = os.sysconf("SC_CLK_TCK")
_SETTLE_LIMIT_S = 120.0


def tree_cpu_s(root: int) -> float:
    """User + system CPU seconds of `root` and every process below it."""
    parents: dict[int, int] = {}
    cpu: dict[int, float] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        pid = int(entry.name)
        parents[pid], cpu[pid] = int(fields[1]), (int(fields[11]) + int(fields[12])) / _TICKS
    total, todo = 0.0, [root]
    while todo:
        pid = todo.pop()
        total += cpu.get(pid, 0.0)
        todo += [child for child, parent in parents.items() if parent == pid]
    return total


async def _get(session: aiohttp.ClientSession, url: str) -> Any:
    async with session.get(url, timeout=aiohttp.ClientTimeout(total=5)) as response:
        return await response.json()


def _envoy_hosts(clusters: dict[str, Any]) -> int:
    return sum(
        len(c.get("host_statuses", []))
        for c in clusters.get("cluster_statuses", [])
        if c["name"] in ("prefill_pool", "decode_pool")
    )


async def measure(pods: int) -> None:
    async with fake_kube_api() as kube:
        source = {"inference_pool": {"name": "llama"}}
        config = ephemeral_config([], [])
        config["prefill"], config["decode"] = source, source
        config["discovery"] = {"kubernetes_api": kube.url, "ca_file": "/nonexistent"}
        kube.put_pool(inference_pool("llama", {"app": "sim"}, 8000))
        async with running_sidecar(config) as sidecar, aiohttp.ClientSession() as session:
            cpu_before, started = tree_cpu_s(sidecar.pid), time.monotonic()
            for i in range(pods):
                labels = {"app": "sim", ROLE: "prefill" if i % 2 else "decode"}
                kube.put_pod(pod(f"pod-{i}", f"10.77.{i // 250}.{i % 250 + 1}", labels))
            ready_at = envoy_at = None
            slow_polls = 0
            while (ready_at is None or envoy_at is None) and (
                time.monotonic() - started < _SETTLE_LIMIT_S
            ):
                polled = time.monotonic()
                try:
                    ready = await _get(session, sidecar.metrics + "/ready?verbose")
                    clusters = await _get(session, sidecar.envoy_admin + "/clusters?format=json")
                except TimeoutError:
                    slow_polls += 1
                    continue
                slow_polls += time.monotonic() - polled > 1.0
                now = time.monotonic() - started
                if ready_at is None and len(ready["prefill"]) + len(ready["decode"]) == pods:
                    ready_at = now
                if envoy_at is None and _envoy_hosts(clusters) == pods:
                    envoy_at = now
                await asyncio.sleep(0.2)
            settled_cpu = tree_cpu_s(sidecar.pid) - cpu_before
            await asyncio.sleep(10)
            idle_cpu = tree_cpu_s(sidecar.pid) - cpu_before - settled_cpu

            def shown(at: float | None) -> str:
                return f"{at:.1f} s" if at is not None else f"not within {_SETTLE_LIMIT_S:g} s"

            print(
                f"{pods} pods: /ready has them all after {shown(ready_at)}, Envoy (EDS) after "
                f"{shown(envoy_at)}; CPU until then {settled_cpu:.1f} s, in the 10 s after "
                f"{idle_cpu:.1f} s; polls slower than 1 s: {slow_polls}; "
                f"watch requests: {len(kube.watches('pods'))}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pods", type=int, default=3000)
    asyncio.run(measure(parser.parse_args().pods))


if __name__ == "__main__":
    main()
