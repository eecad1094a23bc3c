#!/usr/bin/env python3
"""What one body costs the ext_proc's event loop, by prompt size: finding the body's members
(`protocol.bodies.members`, the splice's scan) and building the body answer Envoy gets
(`request.envoy_msgs`), each beside orjson's full parse and protobuf's serialisation of the
same bytes as yardsticks, and the same functions at a baseline commit in the same run.

    python bench/body_costs.py [--baseline REV] [--sizes 2000,20000,200000,2000000]

Prints a table and writes bench/results/body-costs.md and body-costs.png.
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import matplotlib
import orjson

matplotlib.use("Agg")
import matplotlib.pyplot as plt

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

RESULTS = ROOT / "bench" / "results"
MODULES = {"bodies": "extproc/protocol/bodies.py", "envoy_msgs": "extproc/request/envoy_msgs.py"}


def module_at(rev: str | None, name: str) -> ModuleType:
    """One of MODULES as it is now (rev None) or as it was at `rev`, loaded from its source
    (its own imports resolve against today's tree, which these two modules allow)."""
    path = MODULES[name]
    source = (ROOT / path).read_text() if rev is None else _git_show(rev, path)
    spec = importlib.util.spec_from_loader(f"_bench_{name}_{rev or 'now'}", loader=None)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # a dataclass looks its module up there
    exec(compile(source, f"{rev or 'now'}:{path}", "exec"), module.__dict__)
    return module


def _git_show(rev: str, path: str) -> str:
    command = ["git", "-C", str(ROOT), "show", f"{rev}:{path}"]
    return subprocess.run(command, capture_output=True, text=True, check=True).stdout


def fastest_us(call: Callable[[], object], rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        started = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - started)
    return best * 1e6


def body_of(size: int) -> bytes:
    """A completion body whose prompt is `size` bytes of text with newlines (escaped in JSON)."""
    line = "a line of a long prompt\n"
    return orjson.dumps({"model": "m", "prompt": (line * (size // len(line) + 1))[:size], "n": 1})


def costs(rev: str | None, raw: bytes, rounds: int) -> dict[str, float]:
    bodies, msgs = module_at(rev, "bodies"), module_at(rev, "envoy_msgs")
    # since a leg's body is kept as its pieces (`Spliced`), and D's streamed one goes out in
    # chunks of a MiB (`streamed_body_answers`); revisions before either take the bytes
    body = bodies.Spliced((raw,), len(raw)) if hasattr(bodies, "Spliced") else raw
    if hasattr(msgs, "streamed_body_answers"):
        streamed = lambda: list(msgs.streamed_body_answers(body))  # noqa: E731
    else:
        streamed = lambda: msgs.streamed_body_answer(raw)  # noqa: E731
    return {
        "members": fastest_us(lambda: bodies.members(raw), rounds),
        "body answer": fastest_us(lambda: msgs.body_answer(body, ["10.0.0.1:8200"], "r"), rounds),
        "streamed answer": fastest_us(streamed, rounds),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", help="a git revision to measure beside the tree")
    parser.add_argument("--sizes", default="2000,20000,200000,2000000")
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    revs: list[str | None] = [None] + ([args.baseline] if args.baseline else [])
    lines = [
        "| prompt bytes | what | "
        + " | ".join(f"{rev or 'this tree'} (µs)" for rev in revs)
        + " | orjson.loads (µs) | SerializeToString (µs) |",
        "|---:|---|" + "---:|" * (len(revs) + 2),
    ]
    plotted: dict[str, list[float]] = {}
    sizes = [int(s) for s in args.sizes.split(",")]
    for size in sizes:
        raw = body_of(size)
        parse_us = fastest_us(lambda raw=raw: orjson.loads(raw), args.rounds)
        answer = module_at(None, "envoy_msgs").body_answer(raw, ["10.0.0.1:8200"], "r")
        serialise_us = fastest_us(answer.SerializeToString, args.rounds)
        by_rev = {rev: costs(rev, raw, args.rounds) for rev in revs}
        for what in by_rev[None]:
            figures = " | ".join(f"{by_rev[rev][what]:.1f}" for rev in revs)
            lines.append(f"| {size} | {what} | {figures} | {parse_us:.1f} | {serialise_us:.1f} |")
            for rev in revs:
                plotted.setdefault(f"{what} @ {rev or 'this tree'}", []).append(by_rev[rev][what])
    table = "\n".join(lines)
    print(table)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "body-costs.md").write_text(
        "# One body's cost on the event loop (bench/body_costs.py, best of "
        f"{args.rounds})\n\n{table}\n"
    )
    figure, axes = plt.subplots(figsize=(7, 4))
    for label, values in plotted.items():
        axes.loglog(sizes, values, marker="o", label=label)
    axes.set_xlabel("prompt bytes")
    axes.set_ylabel("µs (best of rounds)")
    axes.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(RESULTS / "body-costs.png", dpi=110)


if __name__ == "__main__":
    main()
