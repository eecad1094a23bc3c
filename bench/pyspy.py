"""Sample a running Python process with py-spy and name its top costs.

py-spy's raw format is one collapsed stack per line ("outer;...;inner count"); the top
*self* costs say where the CPU goes, the top *inclusive* ones say which calls are expensive.
"""

from __future__ import annotations

import asyncio
import shutil
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def pyspy_binary() -> str | None:
    here = Path(sys.executable).with_name("py-spy")
    return str(here) if here.exists() else shutil.which("py-spy")


async def record(pid: int, seconds: float, out: Path, rate_hz: int = 200) -> Path | None:
    """Record `seconds` of samples of `pid` into `out` (raw collapsed stacks); None if no py-spy."""
    binary = pyspy_binary()
    if binary is None:
        return None
    process = await asyncio.create_subprocess_exec(
        binary,
        "record",
        "--pid",
        str(pid),
        "--duration",
        str(int(seconds)),
        "--rate",
        str(rate_hz),
        "--format",
        "raw",
        "--output",
        str(out),
        "--nonblocking",
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        _, err = await asyncio.wait_for(process.communicate(), seconds + 30)
    except TimeoutError:
        process.kill()
        await process.wait()
        raise
    if process.returncode != 0 or not await asyncio.to_thread(out.exists):
        raise RuntimeError(f"py-spy failed ({process.returncode}): {err.decode()[-500:]}")
    return out


def summarize(
    raw: Path, top: int = 15, only: str = ""
) -> tuple[int, list[tuple[str, int]], list[tuple[str, int]]]:
    """(total samples, top self frames, top inclusive frames) of a raw py-spy file; `only`
    keeps inclusive frames whose location contains it (e.g. "extproc/")."""
    self_cost: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count, frames = int(count_text), stack.split(";")
        total += count
        self_cost[_short(frames[-1])] += count
        for frame in {_short(f) for f in frames}:
            if only in frame:
                inclusive[frame] += count
    return total, self_cost.most_common(top), inclusive.most_common(top)


def _short(frame: str) -> str:
    """'fn (/long/path/site-packages/pkg/mod.py:12)' → 'fn (pkg/mod.py:12)'."""
    name, _, where = frame.partition(" (")
    for marker in ("site-packages/", f"{ROOT}/", "lib/python3.11/"):
        if marker in where:
            where = where.split(marker, 1)[1]
    return f"{name} ({where}" if where else name
