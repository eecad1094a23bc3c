#!/usr/bin/env python3
"""The lab against the process benchmark: TTFT p50 and p99 of one plan, cell by cell.

Every cell (topology, workload, configuration, concurrency C) runs the same plan twice:

- on processes: vllmsim push engines (`--profile`, default gpu-8b) on the real clock behind
  pd-extproc's Envoy and ext_proc, driven by `vllm bench serve` (bench/client.py), engines and
  client on one CPU and the proxy on the other (bench/run.py's split); each run starts on
  empty prefix caches and the engines' step lateness is read at both of its ends;
- on the lab: the same config file, topology, profile and prompts, on the virtual clock, with
  the lab's default proxy costs (pd-extproc's).

The plan: `warmups(C)` warm-ups at C sending the first prompt (as `vllm bench serve` sends
them), then `--requests` prompts (default 128 at every C, so that a p99 is not the maximum of a
handful) at C.

  seed           PR #187's: 1024 tokens in (with the BOS), 64 out, random one-token words
                 (bench/workload.py's `random_words`; not `vllm bench serve --dataset-name
                 random`, whose prompts repeat whole on the tiny model's small vocabulary)
  shared-prefix  bench/workload.py's `shared_prefix` (8 groups' 1024-token system prompts, a
                 fresh 64-token question each)

The client sends each row's text (`--dataset-name custom --disable-shuffle`), the lab its token
ids (the tiny tokenizer's, with the BOS the engines add): the same prompts, in the same order.

Configurations (bench/cache.py's): `rr` round robin on both pools, push (pd-rr); `kv`
kv_cache on both pools, fed the engines' KV events, push (pd-cache).

    python bench/lab_fidelity.py --topologies 1P1D   # processes + lab
    python bench/lab_fidelity.py --lab-only --write   # the lab again, against the kept runs

Process figures are kept in bench/results/lab-fidelity.json, cell by cell (a run replaces the
cells it ran), so that the lab's side can be re-run alone; `--write` writes lab-fidelity.md.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import yaml

from lab.engines import parse_topology
from lab.run import Session, Settings, percentile, run_virtual_session
from lab.sidecar import PROXIES
from lab.workloads import Chain, LabRequest, Workload
from vllmsim.config import CostModel
from vllmsim.profiles import PROFILES

RESULTS = Path(__file__).resolve().parent / "results"
WORKLOADS = ("seed", "shared-prefix")
CONFIGS = {"rr": "pd-rr", "kv": "pd-cache"}  # this table's names → bench/cache.py's
TOLERANCE = 0.10
# The engines ran on time when their steps ended at most this late on average and at most
# LATE_TAIL_SHARE of them more than LATE_TAIL_MS late (bench/calibrate.py's rule).
LATE_MEAN_MS, LATE_TAIL_MS, LATE_TAIL_SHARE = 1.0, 10.0, 0.01
SEED = 1


@dataclass(frozen=True, order=True)
class Cell:
    topology: str
    workload: str
    config: str
    concurrency: int
    instant: bool = False  # on near-instant engines: what the processes add to the model

    @property
    def id(self) -> str:
        tail = "-instant" if self.instant else ""
        return f"{self.topology}-{self.workload}-{self.config}-c{self.concurrency}{tail}"


def instant_cost(profile: str) -> CostModel:
    """The profile with bench/engines.py's INSTANT flags applied, as vllmsim applies them."""
    from bench.engines import INSTANT

    flags = dict(zip(INSTANT[::2], INSTANT[1::2], strict=True))
    fields = {f.removeprefix("--").replace("-", "_"): float(v) for f, v in flags.items()}
    return dataclasses.replace(PROFILES[profile], **fields)


def warmups(concurrency: int) -> int:
    """bench/client.py's default: a wave of C warm-ups, within 2..8."""
    return min(max(2, concurrency), 8)


# -- the prompts -----------------------------------------------------------------------------


def rows(cell: Cell, requests: int, tokenizer_dir: Path | None = None) -> list[dict[str, Any]]:
    """The cell's measured prompts, bench/workload.py's rows (text of an exact token count;
    each cell its own words): `random_words` for the seed plan, `shared_prefix`."""
    from bench.workload import random_words, shared_prefix
    from scripts.cached_envs import tiny_model

    folder = tokenizer_dir or tiny_model()
    if cell.workload == "seed":
        return random_words(folder, requests, seed=cell.concurrency)
    salt = f"{cell.topology}/c{cell.concurrency}"
    return shared_prefix(folder, count=requests, seed=SEED, salt=salt)


def lab_requests(cell: Cell, requests: int, tokenizer_dir: Path | None = None) -> list[LabRequest]:
    """The same prompts as the lab's clients send them: each row's token ids (the tokenizer's,
    with the BOS the engines add), in the same order."""
    from tokenizers import Tokenizer

    from scripts.cached_envs import tiny_model

    folder = tokenizer_dir or tiny_model()
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    return [
        LabRequest(tokenizer.encode(row["prompt"]).ids, row["output_tokens"])
        for row in rows(cell, requests, folder)
    ]


# -- the figures -----------------------------------------------------------------------------


def quantiles(ttfts_ms: list[float]) -> dict[str, float | None]:
    return {"p50": percentile(ttfts_ms, 50), "p99": percentile(ttfts_ms, 99)}


def lateness(delta: dict[str, Any] | None) -> dict[str, float] | None:
    """A run's step lateness (bench/engines.py's delta): mean ms per step, share > 10 ms."""
    if not delta or not delta.get("steps"):
        return None
    steps = delta["steps"]
    tail = sum(n for le, n in delta["buckets_ms"].items() if float(le) > LATE_TAIL_MS)
    return {"mean_ms": 1e3 * delta["late_s"] / steps, "tail_share": tail / steps}


def on_time(late: dict[str, float] | None) -> bool | None:
    if late is None:
        return None
    return late["mean_ms"] <= LATE_MEAN_MS and late["tail_share"] <= LATE_TAIL_SHARE


def within(lab: float | None, process: float | None) -> bool | None:
    if lab is None or not process:
        return None
    return abs(lab / process - 1) <= TOLERANCE


def _ms(value: float | None) -> str:
    return "—" if value is None else f"{value:.1f}"


def _ratio(lab: float | None, process: float | None) -> str:
    if lab is None or not process:
        return "—"
    text = f"{lab / process:.2f}"
    return text if within(lab, process) else f"**{text}**"


def _yes(flag: bool | None) -> str:
    return "—" if flag is None else ("yes" if flag else "**no**")


def table(rows: Iterable[dict[str, Any]]) -> list[str]:
    """Markdown, one line per cell: the process's and the lab's p50 and p99, lab / process
    (misses in bold), within ±10 % for both, the engines' step lateness and whether they ran
    on time. A row: {"cell": Cell, "process": {...} | None, "lab": {...} | None}."""
    lines = [
        "| topology | workload | config | C | process p50 | lab p50 | lab / process | "
        "process p99 | lab p99 | lab / process | both within ±10 % | "
        "steps late: mean ms, share > 10 ms | on time |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in sorted(rows, key=lambda r: r["cell"]):
        cell: Cell = row["cell"]
        proc = row.get("process") or {}
        lab = row.get("lab") or {}
        p, q = proc.get("ttft_ms", {}), lab.get("ttft_ms", {})
        checks = [within(q.get(k), p.get(k)) for k in ("p50", "p99")]
        both = None if None in checks else all(checks)
        late = proc.get("lateness")
        late_text = "—" if late is None else f"{late['mean_ms']:.2f}, {late['tail_share']:.1%}"
        config = f"{cell.config}, instant engines" if cell.instant else cell.config
        lines.append(
            f"| {cell.topology} | {cell.workload} | {config} | {cell.concurrency} | "
            f"{_ms(p.get('p50'))} | {_ms(q.get('p50'))} | {_ratio(q.get('p50'), p.get('p50'))} | "
            f"{_ms(p.get('p99'))} | {_ms(q.get('p99'))} | {_ratio(q.get('p99'), p.get('p99'))} | "
            f"{_yes(both)} | {late_text} | {_yes(on_time(late))} |"
        )
    return lines


def _gap(row: dict[str, Any] | None, key: str) -> float | None:
    """process − lab (ms) at one percentile, None where either is missing."""
    if not row or not row.get("process") or not row.get("lab"):
        return None
    p, q = row["process"]["ttft_ms"].get(key), row["lab"]["ttft_ms"].get(key)
    return None if p is None or q is None else p - q


def floors(rows: Iterable[dict[str, Any]]) -> list[str]:
    """Markdown, one line per cell that also ran on instant engines: what the processes add
    to the lab's TTFT (process − lab, ms) with the profile's engines and with instant ones,
    whose model costs next to nothing: there the gap is the processes' own floor (the
    client, HTTP, the simulator's Python, late steps), not the model's."""
    by_cell = {r["cell"]: r for r in rows}
    lines = [
        "| topology | workload | config | C | process − lab p50 | instant engines: process − "
        "lab p50 | process − lab p99 | instant engines: process − lab p99 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for cell in sorted(c for c in by_cell if not c.instant):
        twin = by_cell.get(dataclasses.replace(cell, instant=True))
        if twin is None:
            continue
        row = by_cell[cell]
        gaps = [_gap(row, "p50"), _gap(twin, "p50"), _gap(row, "p99"), _gap(twin, "p99")]
        lines.append(
            f"| {cell.topology} | {cell.workload} | {cell.config} | {cell.concurrency} | "
            + " | ".join(_ms(g) for g in gaps)
            + " |"
        )
    return lines


def tally(rows: Iterable[dict[str, Any]]) -> str:
    """One line: how many cells are within ±10 % on both, of those measured; and of those
    whose engines ran on time."""
    done = [r for r in rows if r.get("process") and r.get("lab")]

    def ok(r: dict[str, Any]) -> bool:
        p, q = r["process"]["ttft_ms"], r["lab"]["ttft_ms"]
        return all(within(q[k], p[k]) for k in ("p50", "p99"))

    timely = [r for r in done if on_time(r["process"].get("lateness"))]
    return (
        f"{sum(map(ok, done))} of {len(done)} cells within ±10 % on p50 and p99; "
        f"{sum(map(ok, timely))} of the {len(timely)} whose engines ran on time"
    )


# -- the lab's side --------------------------------------------------------------------------


def _closed(requests: list[LabRequest], concurrency: int) -> Workload:
    return Workload("fidelity", [Chain([r]) for r in requests], False, concurrency)


def lab_cell(cell: Cell, config: dict[str, Any], requests: int, profile: str) -> dict[str, Any]:
    """The cell's plan on the lab: warm-ups, then the measured prompts; TTFT p50 / p99 (ms)."""
    cost = instant_cost(profile) if cell.instant else PROFILES[profile]
    settings = Settings(parse_topology(cell.topology), cost, PROXIES["pd-extproc"])
    measured = lab_requests(cell, requests)

    async def body(lab: Session) -> list[Any]:
        await lab.drive(_closed([measured[0]] * warmups(cell.concurrency), cell.concurrency))
        lab.reset_totals()
        return await lab.drive(_closed(measured, cell.concurrency))

    with tempfile.TemporaryDirectory(prefix="lab-fidelity-") as folder:
        path = Path(folder) / f"{cell.config}.yaml"
        path.write_text(yaml.safe_dump(config))
        outcomes = run_virtual_session(path, settings, body)
    ttfts = [1e3 * o.ttft_s for o in outcomes if o.ok and o.ttft_s is not None]
    return {"ttft_ms": quantiles(ttfts), "ok": len(ttfts), "failed": len(outcomes) - len(ttfts)}


# -- the processes' side ---------------------------------------------------------------------


async def process_topology(
    topology: str, cells: list[Cell], args: argparse.Namespace, work: Path
) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
    """Every cell of one topology on processes: ({cell id: figures}, {config: its file})."""
    import aiohttp

    from bench.client import run_plan
    from bench.engines import lateness_delta, reset_prefix_caches, step_lateness
    from bench.run import MODEL
    from scripts.cached_envs import tiny_model

    async with contextlib.AsyncExitStack() as stack:
        engines, files, urls = await _start(stack, topology, cells, args, work)
        runs = [_run(cell, urls[cell.config], args.requests, work) for cell in cells]
        late: dict[str, dict[str, Any]] = {}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
            last: dict[str, Any] = {}

            async def between(done: str | None, upcoming: str | None) -> None:
                """Each run's step lateness, and each run on empty prefix caches."""
                nonlocal last
                now = await step_lateness(http, [engines])
                if done is not None:
                    late[done] = lateness_delta(now, last)
                if upcoming is not None:
                    await reset_prefix_caches(http, [engines])
                last = now

            engine_cpus = _cpus()[0]
            results = await run_plan(runs, MODEL, tiny_model(), work, engine_cpus, between)
    by_id = {cell.id: cell for cell in cells}
    return {
        run.id: _figures(by_id[run.id], results[run.id], late.get(run.id), args.requests)
        for run in runs
    }, files


def _cpus() -> tuple[set[int] | None, set[int] | None]:
    from bench.run import cpu_split

    return cpu_split(True)  # (engines and client, the proxy): bench/run.py's split


async def _start(
    stack: contextlib.AsyncExitStack,
    topology: str,
    cells: list[Cell],
    args: argparse.Namespace,
    work: Path,
) -> tuple[Any, dict[str, dict[str, Any]], dict[str, str]]:
    """The topology's push engines (with KV events when `kv` runs) and one sidecar per
    configuration: (engines, {config: its file}, {config: its URL})."""
    from bench.cache import CONFIGS as BENCH_CONFIGS
    from bench.cache import EventFlags, extproc_config, running_config
    from bench.engines import DEV_MODE, INSTANT, running_engines
    from bench.run import MODEL
    from scripts.cached_envs import tiny_model

    shape = parse_topology(topology)
    engine_cpus, proxy_cpus = _cpus()
    configs = sorted({c.config for c in cells})
    flags = EventFlags("kv" in configs, work / f"events-{topology}")
    flags.folder.mkdir()
    cost_flags = ("--profile", args.profile, *(INSTANT if args.instant else ()))
    engines = await stack.enter_async_context(
        running_engines(
            "push",
            shape.prefill,
            shape.decode,
            MODEL,
            tiny_model(),
            cost_flags,
            engine_cpus,
            flags,
            DEV_MODE,
        )
    )
    events = flags.endpoints(engines)
    files, urls = {}, {}
    for name in configs:
        config = BENCH_CONFIGS[CONFIGS[name]]
        files[name] = extproc_config(config, engines, events)
        target = await stack.enter_async_context(
            running_config(config, engines, events, proxy_cpus)
        )
        urls[name] = target.url
    return engines, files, urls


def _run(cell: Cell, url: str, requests: int, work: Path) -> Any:
    """The cell's `vllm bench serve` run: its rows as a custom dataset, in order."""
    from bench.client import Run
    from bench.workload import write

    dataset = work / f"{cell.id}.jsonl"
    mine = rows(cell, requests)
    write(dataset, [{"prompt": r["prompt"], "output_tokens": r["output_tokens"]} for r in mine])
    return Run(
        cell.id,
        cell.topology,
        cell.config,
        cell.concurrency,
        0,
        url,
        work / f"{cell.id}.json",
        dataset,
        num_prompts=requests,
        num_warmups=warmups(cell.concurrency),
        seed=SEED,
        flags=("--disable-shuffle",),  # the rows in order, as the lab sends them
    )


def _figures(
    cell: Cell, result: dict[str, Any], late: dict[str, Any] | None, requests: int
) -> dict[str, Any]:
    """What is kept of one process run: TTFT p50 / p99 and every TTFT (ms), the prompt
    lengths the engines counted, the step lateness."""
    from bench.run import _slim

    ttfts = _slim(result).get("ttfts_ms", [])
    return {
        "cell": dataclasses.asdict(cell),
        "ttft_ms": quantiles(ttfts),
        "ok": len(ttfts),
        "failed": requests - len(ttfts),
        "input_lens": sorted(set(result.get("input_lens", []))),
        "lateness": lateness(late),
        "ttfts": ttfts,
    }


# -- the command -----------------------------------------------------------------------------


def _cells(args: argparse.Namespace) -> list[Cell]:
    return [
        Cell(t, w, c, conc, args.instant)
        for t in args.topologies
        for w in args.workloads
        for c in args.configs
        for conc in args.concurrency
        if not (c == "kv" and w == "seed")  # kv_cache on random prompts is round robin's test
    ]


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--topologies", default="1P1D,2P2D")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--configs", default="rr", help=f"comma list of {sorted(CONFIGS)}")
    parser.add_argument("--concurrency", default="1,2,4,8,16")
    parser.add_argument("--requests", type=int, default=128, help="measured prompts per cell")
    parser.add_argument("--profile", default="gpu-8b", choices=sorted(PROFILES))
    parser.add_argument(
        "--lab-only", action="store_true", help="the lab only, against the kept process runs"
    )
    parser.add_argument(
        "--instant",
        action="store_true",
        help="near-instant engines (bench/engines.py's INSTANT) on both sides: the processes' "
        "own floor against the model's",
    )
    parser.add_argument("--write", action="store_true", help="write bench/results/lab-fidelity.md")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    args.topologies = args.topologies.split(",")
    args.workloads = args.workloads.split(",")
    args.configs = args.configs.split(",")
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    for name, known in (("workloads", WORKLOADS), ("configs", tuple(CONFIGS))):
        unknown = set(getattr(args, name)) - set(known)
        if unknown:
            parser.error(f"unknown {name} {sorted(unknown)}; choose from {list(known)}")
    for topology in args.topologies:
        try:
            shape = parse_topology(topology)
        except ValueError as error:
            parser.error(str(error))
        if shape.prefill != shape.decode:
            parser.error(f"{topology}: the process benchmark runs nPnD only")
    return args


def _load(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {"cells": {}, "configs": {}, "runs": []}
    data: dict[str, Any] = json.loads(path.read_text())
    return data


async def _processes(args: argparse.Namespace, cells: list[Cell], kept: dict[str, Any]) -> None:
    for topology in args.topologies:
        mine = [c for c in cells if c.topology == topology]
        if not mine:
            continue
        load_before, started = os.getloadavg(), time.monotonic()
        with tempfile.TemporaryDirectory(prefix="lab-fidelity-") as tmp:
            figures, files = await process_topology(topology, mine, args, Path(tmp))
        kept["cells"].update(figures)
        for name, config in files.items():
            kept["configs"][f"{topology}/{name}"] = config
        ran = {c.id for c in mine}  # a run's note stays while some of its cells are kept
        kept["runs"] = [r for r in kept["runs"] if set(r["cells"]) - ran]
        kept["runs"].append(
            {
                "topology": topology,
                "cells": [c.id for c in mine],
                "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                "duration_s": round(time.monotonic() - started),
                "load_before": " ".join(f"{x:.2f}" for x in load_before),
                "load_after": " ".join(f"{x:.2f}" for x in os.getloadavg()),
                "requests": args.requests,
                "profile": args.profile,
            }
        )


def _default_config(name: str) -> dict[str, Any]:
    """A config as bench/cache.py starts it, for a cell without a kept process run."""
    from bench.cache import CONFIGS as BENCH_CONFIGS
    from bench.cache import extproc_config
    from bench.engines import Engines

    return extproc_config(BENCH_CONFIGS[CONFIGS[name]], Engines("push", [], []), {})


def main() -> None:
    args = _parse()
    cells = _cells(args)
    store = args.out / "lab-fidelity.json"
    kept = _load(store)
    if not args.lab_only:
        from bench.procs import run_bench

        run_bench(_processes(args, cells, kept))
        args.out.mkdir(parents=True, exist_ok=True)
        store.write_text(json.dumps(kept, indent=1))
    if args.write:  # the file has every cell measured so far, not only this run's
        kept_cells = [Cell(**f["cell"]) for f in kept["cells"].values() if "cell" in f]
        cells = sorted(set(cells) | set(kept_cells))
    rows = []
    for cell in cells:
        config = kept["configs"].get(f"{cell.topology}/{cell.config}") or _default_config(
            cell.config
        )
        lab = lab_cell(cell, config, args.requests, args.profile)
        rows.append({"cell": cell, "process": kept["cells"].get(cell.id), "lab": lab})
        print(table([rows[-1]])[-1], flush=True)
    lines = [*table(rows), "", *floors(rows)]
    print("\n".join(lines))
    print(tally(rows))
    if args.write:
        runs = "; ".join(
            f"{r['topology']} {r['when']}, {r['duration_s']} s, load average {r['load_before']} "
            f"→ {r['load_after']}"
            for r in kept["runs"]
        )
        head = [
            "# The lab against the process benchmark (`python bench/lab_fidelity.py`)",
            "",
            f"Profile {args.profile}; {args.requests} measured prompts per cell after "
            f"min(max(2, C), 8) warm-ups; process runs: {runs or 'none'}.",
            "",
        ]
        (args.out / "lab-fidelity.md").write_text("\n".join([*head, *lines, "", tally(rows), ""]))
        print(f"wrote {args.out / 'lab-fidelity.md'}")


if __name__ == "__main__":
    main()
