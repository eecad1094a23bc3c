"""Several ext_proc processes (and replicas) against one: the lab's figures, W = 1, 2, 4.

Runs the lab (virtual time: the figures do not depend on the machine) on 2P2D and 4P4D with
`--prefill-kv-blocks 1280`, shared-prefix and multi-turn (turn waves, 12 x C requests) at
C = 4, 16, 64, for three configurations, each at W ext_proc processes of one sidecar and, with
`--replicas`, at R sidecars of one process each:

- `rr`: round robin on both pools (the reference of every ratio, run at the same W);
- `kvla`: `kv_cache` on both pools with KV events and `decision: {mode: load_aware}`;
- `approx`: the same without KV events (routed by what was sent where).

`kvla` and `approx` run twice: each process with its own view of the load
(`extproc.share_load: false`, as before the shared table) and with the shared one (the
default). Figures: TTFT p50 / p99 in simulated ms.

    python bench/lab_workers.py                      # the table on stdout
    python bench/lab_workers.py --write FILE         # and as markdown in FILE
    python bench/lab_workers.py --spreads 1x1,1x2    # R = 2 replicas of one process
    python bench/lab_workers.py --warm               # without the cold start's first wave
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from lab.engines import parse_topology
from lab.run import Settings, percentile, run_config
from lab.workloads import generate
from vllmsim.profiles import PROFILES

_KV = "policy: kv_cache, kv_events: {port: 5557}"
_APPROX = "policy: kv_cache"
CONFIGS = {
    "rr": "dispatch: {mode: push}\ndecision: {mode: off}\n"
    "prefill: {policy: round_robin, endpoints: [127.0.0.1:8100]}\n"
    "decode: {policy: round_robin, endpoints: [127.0.0.1:8200]}\n",
    "kvla": "dispatch: {mode: push}\ndecision: {mode: load_aware}\n"
    f"prefill: {{{_KV}, endpoints: [127.0.0.1:8100]}}\n"
    f"decode: {{{_KV}, endpoints: [127.0.0.1:8200]}}\n",
    "approx": "dispatch: {mode: push}\ndecision: {mode: load_aware}\n"
    f"prefill: {{{_APPROX}, endpoints: [127.0.0.1:8100]}}\n"
    f"decode: {{{_APPROX}, endpoints: [127.0.0.1:8200]}}\n",
}


def _config(folder: Path, name: str, shared: bool) -> Path:
    path = folder / f"{name}{'' if shared else '-own'}.yaml"
    path.write_text(CONFIGS[name] + ("" if shared else "extproc: {share_load: false}\n"))
    return path


def _warm(
    summary: dict[str, Any], folder: Path, name: str, workload: str, concurrency: int
) -> dict[str, Any]:
    """`summary` with TTFT p50 and p99 of the requests after the cold start's first wave:
    shared-prefix's first C requests, multi-turn's first turns."""
    rows = [json.loads(line) for line in (folder / f"{name}.requests.jsonl").open()]
    if workload == "multi-turn":
        kept = [r["ttft_ms"] for r in rows if r["turn"] >= 1 and r["ttft_ms"] is not None]
    else:
        kept = [
            r["ttft_ms"] for r in rows if r["chain"] >= concurrency and r["ttft_ms"] is not None
        ]
    return summary | {"ttft_ms": {"p50": percentile(kept, 50), "p99": percentile(kept, 99)}}


def run_cell(
    folder: Path,
    topology: str,
    workload: str,
    concurrency: int,
    spread: tuple[int, int],
    seed: int = 1,
    warm: bool = False,
) -> dict[str, dict[str, Any]]:
    """Each configuration's summary on one cell, `spread` = (W, R): `rr`, and `kvla` and
    `approx` each with its own view (`-own`, extproc.share_load off) and the shared one."""
    count = 12 * concurrency if workload == "multi-turn" else 256
    load = generate(workload, seed, concurrency, count=count)
    settings = Settings(
        parse_topology(topology),
        PROFILES["gpu-8b"],
        seed=seed,
        workers=spread[0],
        replicas=spread[1],
        prefill_kv_blocks=1280,
        turn_waves=workload == "multi-turn",
        per_request=folder / "requests" if warm else None,
    )
    found = {}
    for name, shared in [("rr", True), *itertools.product(("kvla", "approx"), (False, True))]:
        path = _config(folder, name, shared)
        summary = run_config(path, load, settings)
        if warm:
            summary = _warm(summary, folder / "requests", path.stem, workload, concurrency)
        found[path.stem] = summary
    return found


def _ms(summary: dict[str, Any]) -> str:
    ttft = summary["ttft_ms"]
    return f"{ttft['p50']:.0f} / {ttft['p99']:.0f}"


HEADER = (
    "| topology | workload | C | W | R | rr | kvla, own view | kvla, shared | "
    "approx, own view | approx, shared |"
)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", type=Path)
    parser.add_argument("--topologies", default="2P2D,4P4D")
    parser.add_argument("--workloads", default="shared-prefix,multi-turn")
    parser.add_argument("--concurrency", default="4,16,64")
    parser.add_argument("--spreads", default="1x1,2x1,4x1", help="W x R cells, e.g. 1x2")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--warm", action="store_true", help="TTFT after the first wave of a cold cluster"
    )
    args = parser.parse_args(argv)
    spreads = [tuple(int(n) for n in s.split("x")) for s in args.spreads.split(",")]
    lines = [HEADER, "|" + "---|" * 10]
    with tempfile.TemporaryDirectory(prefix="lab-workers-") as folder:
        for topology in args.topologies.split(","):
            for workload in args.workloads.split(","):
                for c in (int(c) for c in args.concurrency.split(",")):
                    for workers, replicas in spreads:
                        spread = (workers, replicas)
                        cell = run_cell(
                            Path(folder), topology, workload, c, spread, args.seed, args.warm
                        )
                        figures = " | ".join(
                            _ms(cell[k]) for k in ("rr", "kvla-own", "kvla", "approx-own", "approx")
                        )
                        cells = f"{topology} | {workload} | {c} | {workers} | {replicas}"
                        line = f"| {cells} | {figures} |"
                        lines.append(line)
                        print(line, flush=True)
    if args.write is not None:
        args.write.write_text("\n".join(lines) + "\n")
    print(f"done: {len(lines) - 2} cells", file=sys.stderr)


if __name__ == "__main__":
    main()
