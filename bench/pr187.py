"""vllm-project/router PR #187's push table, and its plan on the lab: what the `gpu-8b` profile
is fitted to and checked against.

Setup as the PR states it: 4 prefill + 4 decode GPU engines, `vllm bench serve --dataset-name
random --random-input-len 1024 --random-output-len 64 --random-range-ratio 0`, 2 x C prompts at
`--max-concurrency` C; each cell is the best mean TTFT (ms) of 4 runs. Columns: NIXL pull with
the sequential router, NIXL push with the sequential router, NIXL push with both legs at once.

The plan runs on the lab (docs/lab.md): pd-extproc's own scheduler from a round-robin config
whose `dispatch.mode` is the column's (`pull`, `serial_push`, `push`), vllmsim's engines and
connectors, on a virtual clock. The proxy's costs are those the profile was fitted with: one
0.3 ms hop each way (client -> proxy -> engine, P's answer back, the D leg out, D's first token
back), what a Rust router adds on the PR's hosts. A cell takes about a second of CPU at C = 8.

    python bench/pr187.py                      # the fidelity table (docs/lab.md), C = 1..512
    python bench/pr187.py --concurrency 1 8 --runs 1
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lab.engines import Topology
from lab.run import Session, Settings, run_virtual_session
from lab.sidecar import ProxyCosts
from lab.workloads import Chain, LabRequest, Workload, random_prompts
from vllmsim.config import CostModel

MODES = ("pull", "serial_push", "push")
ROWS: dict[int, dict[str, float]] = {
    1: {"pull": 74.0, "serial_push": 73.0, "push": 71.0},
    8: {"pull": 159.0, "serial_push": 184.0, "push": 123.0},
    32: {"pull": 191.0, "serial_push": 226.0, "push": 182.0},
    128: {"pull": 248.0, "serial_push": 270.0, "push": 216.0},
    512: {"pull": 2095.0, "serial_push": 2171.0, "push": 2087.0},
}
TOLERANCE = 0.15  # each ratio to pull, and the absolute figure up to ABSOLUTE_UP_TO
ABSOLUTE_UP_TO = 32

INPUT_LEN, OUTPUT_LEN = 1024, 64
WARMUPS = 8  # PR #187's --num-warmups
HOP_MS = 0.3  # one proxy hop on the PR's hosts (a Rust router): what the profile was fitted with
PROXY = ProxyCosts(intake_ms=0.0, answer_ms=HOP_MS, hop_ms=HOP_MS)
RESULTS = Path(__file__).resolve().parent / "results" / "lab-pr187.md"


def _as_configured(lab: Session) -> None:
    """The sidecars as the config builds them (a trial may change them: serial_path_trials)."""


PREPARE: Callable[[Session], None] = _as_configured


def order(row: dict[str, float]) -> str:
    return " < ".join(sorted(row, key=row.__getitem__))


def ratios(row: dict[str, float]) -> dict[str, float]:
    """Each push mode's figure over pull's."""
    return {m: row[m] / row["pull"] for m in MODES[1:]}


def interpolated(concurrency: int) -> dict[str, float]:
    """A row the PR does not have, log-log between its two neighbouring rows: what a smooth
    curve through the PR's rows gives (the check of the profile off its fitted points)."""
    below = max(c for c in ROWS if c <= concurrency)
    above = min(c for c in ROWS if c >= concurrency)
    if below == above:
        return dict(ROWS[below])
    w = math.log(concurrency / below) / math.log(above / below)
    return {
        m: math.exp((1 - w) * math.log(ROWS[below][m]) + w * math.log(ROWS[above][m]))
        for m in MODES
    }


# -- the plan on the lab -----------------------------------------------------------------------


def config_text(mode: str) -> str:
    """pd-extproc's config for a column: round robin and always both legs, as the PR's
    router ran, in the PR's mode."""
    return (
        "prefill: {policy: round_robin, endpoints: [127.0.0.1:8100]}\n"
        "decode: {policy: round_robin, endpoints: [127.0.0.1:8200]}\n"
        "decision: {mode: off}\n"
        f"dispatch: {{mode: {mode}}}\n"
    )


def _closed(prompts: list[list[int]], concurrency: int) -> Workload:
    chains = [Chain([LabRequest(p, OUTPUT_LEN)]) for p in prompts]
    return Workload("pr187", chains, open_loop=False, concurrency=concurrency)


async def _runs(lab: Session, concurrency: int, runs: int, seed: int | None) -> list[float]:
    """Mean TTFT (s) of each run; `seed`: every run's prompts from that seed (PR #187's
    `--seed 42`), None: each run its own (bench/client.py's 1000 + run)."""
    PREPARE(lab)
    means = []
    for run in range(runs):
        batch = random_prompts(1000 + run if seed is None else seed, 2 * concurrency, INPUT_LEN)
        # vllm bench serve's warm-ups, at C, send the first prompt: the engines they reach
        # cache it
        await lab.drive(_closed([batch[0]] * WARMUPS, concurrency))
        outcomes = await lab.drive(_closed(batch, concurrency))
        failed = [o for o in outcomes if not o.ok or o.ttft_s is None]
        if failed:
            raise RuntimeError(f"{len(failed)} requests failed, e.g. {failed[0]}")
        means.append(statistics.fmean(o.ttft_s for o in outcomes if o.ttft_s is not None))
    return means


def mean_ttft_ms(
    cost: CostModel,
    mode: str,
    concurrency: int,
    runs: int = 4,
    n: int = 4,
    seed: int | None = None,
    config: str | None = None,
) -> float:
    """Best (lowest) mean TTFT of `runs` runs, in ms, as PR #187 reports its cells, on nPnD
    engines behind `config` (default: `config_text(mode)`)."""
    settings = Settings(Topology(n, n), cost, PROXY)
    with tempfile.TemporaryDirectory(prefix="pr187-") as folder:
        path = Path(folder) / f"{mode}.yaml"
        path.write_text(config or config_text(mode))
        means = run_virtual_session(path, settings, lambda lab: _runs(lab, concurrency, runs, seed))
    return 1e3 * min(means)


def table(
    cost: CostModel, concurrencies: tuple[int, ...], runs: int = 4, seed: int | None = None
) -> dict[int, dict[str, float]]:
    return {c: {m: mean_ttft_ms(cost, m, c, runs, seed=seed) for m in MODES} for c in concurrencies}


# -- the fidelity table ----------------------------------------------------------------------


def fidelity(rows: dict[int, dict[str, float]]) -> list[str]:
    """Markdown: every cell, the PR's and the lab's, each ratio to pull, the order, the checks
    (each push mode's ratio to pull within TOLERANCE of the PR's; the order the PR's)."""
    lines = [
        "| C | mode | PR ms | lab ms | lab / PR | PR ratio to pull | lab ratio to pull | "
        "ratio within ±15 % |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c, row in rows.items():
        ref = ROWS[c]
        for m in MODES:
            pr_ratio, lab_ratio = ref[m] / ref["pull"], row[m] / row["pull"]
            within = "" if m == "pull" else _yes(abs(lab_ratio / pr_ratio - 1) <= TOLERANCE)
            lines.append(
                f"| {c} | {m} | {ref[m]:.0f} | {row[m]:.1f} | {row[m] / ref[m]:.2f} | "
                f"{pr_ratio:.3f} | {lab_ratio:.3f} | {within} |"
            )
    lines += ["", "| C | PR's order | lab's order | same |", "|---|---|---|---|"]
    for c, row in rows.items():
        same = order(row) == order(ROWS[c])
        lines.append(f"| {c} | {order(ROWS[c])} | {order(row)} | {_yes(same)} |")
    return lines


def _yes(ok: bool) -> str:
    return "yes" if ok else "**no**"


def main() -> None:
    from vllmsim.profiles import PROFILES

    parser = argparse.ArgumentParser(description="PR #187's rows on the lab, beside the PR's")
    parser.add_argument("--profile", default="gpu-8b", choices=sorted(PROFILES))
    parser.add_argument("--concurrency", type=int, nargs="+", default=sorted(ROWS))
    parser.add_argument("--runs", type=int, default=4, help="best mean TTFT of this many runs")
    parser.add_argument("--write", action="store_true", help=f"also write {RESULTS.name}")
    args = parser.parse_args()
    unknown = [c for c in args.concurrency if c not in ROWS]
    if unknown:
        parser.error(f"PR #187 has rows at C = {sorted(ROWS)} only, not {unknown}")
    rows = {}
    for c in args.concurrency:
        rows[c] = {m: mean_ttft_ms(PROFILES[args.profile], m, c, args.runs) for m in MODES}
        print(f"C = {c}: " + ", ".join(f"{m} {v:.1f}" for m, v in rows[c].items()), flush=True)
    lines = fidelity(rows)
    print("\n".join(lines))
    if args.write:
        head = (
            f"# PR #187's rows on the lab (`python bench/pr187.py --write`, profile "
            f"{args.profile}, best of {args.runs} runs)\n\n"
        )
        RESULTS.write_text(head + "\n".join(lines) + "\n")
        print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
