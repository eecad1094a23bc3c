"""Run the README's quick start word for word in a fresh clone and venv, and check the demo.

The commands are read from README.md itself: the fenced block after the `<!-- quickstart`
marker. Two substitutions only: `<url-of-this-repository>` becomes this checkout (its committed
HEAD), and the `pd-extproc demo` line gets `--once --port 0` (the flags the README gives for
exiting after the requests and for a free port). Then the demo's table must show every request
served push-parallel. Prints one line with the durations; exit 1 with the reason otherwise.

    python scripts/readme_quickstart.py            # .ci/run runs this (about a minute)

It clones the committed HEAD: commit README changes before running it by hand.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARKER = "<!-- quickstart"
URL_PLACEHOLDER = "<url-of-this-repository>"
DEMO = "pd-extproc demo"
DEMO_FLAGS = " --once --port 0"
DEMO_REQUESTS = 6  # the demo's default --requests
TABLE_HEADER = "req  prefill  decode"
TIMEOUT_S = 900


def quickstart_commands(readme: str) -> list[str]:
    """The lines of the fenced block that follows the quick-start marker."""
    start = readme.index(MARKER)
    fence = readme.index("```", start)
    body_start = readme.index("\n", fence) + 1
    body_end = readme.index("```", body_start)
    return [line for line in readme[body_start:body_end].splitlines() if line.strip()]


def runnable(commands: list[str], repository: Path) -> list[str]:
    """The commands as run here: this checkout as the URL, the demo exiting after its table."""
    out = []
    for line in commands:
        line = line.replace(URL_PLACEHOLDER, str(repository))
        if line.strip() == DEMO:
            line += DEMO_FLAGS
        out.append(line)
    return out


def demo_rows(output: str) -> list[str]:
    """The rows of the demo's table (after its header line)."""
    lines = output.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith(TABLE_HEADER))
    return [line for line in lines[header + 1 :] if re.match(r"\s*\d+\s", line)]


def _clean_env() -> dict[str, str]:
    """No trace of the venv running this script: the quick start makes and activates its own."""
    env = {k: v for k, v in os.environ.items() if k not in {"VIRTUAL_ENV", "PYTHONPATH"}}
    own_bin = str(Path(sys.executable).parent)
    env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep) if p != own_bin)
    return env


# bash ignores a PS4 from the environment when run as root: the script sets it itself, so the
# trace (stderr) carries each command's start time.
_TRACE = "PS4='+ $(date +%s.%N) '\nset -x\n"


def _durations(trace: str, ended: float) -> str:
    """The install's and the demo's wall time, from the trace's start times."""
    starts = [(float(m[1]), m[2]) for m in re.finditer(r"^\+ (\d+\.\d+) (.*)$", trace, re.M)]
    spans = {
        cmd: nxt - t
        for (t, cmd), nxt in zip(starts, [s for s, _ in starts[1:]] + [ended], strict=True)
    }
    install = next((s for cmd, s in spans.items() if "pip install" in cmd), float("nan"))
    demo = next((s for cmd, s in spans.items() if cmd.startswith(DEMO)), float("nan"))
    return f"install {install:.0f} s, demo {demo:.1f} s"


def main() -> int:
    commands = runnable(quickstart_commands((ROOT / "README.md").read_text()), ROOT)
    with tempfile.TemporaryDirectory(prefix="readme-quickstart-") as tmp:
        script = Path(tmp) / "quickstart.sh"
        script.write_text(_TRACE + "set -euo pipefail\n" + "\n".join(commands) + "\n")
        started = time.monotonic()
        try:
            proc = subprocess.run(
                ["bash", str(script)],
                cwd=tmp,
                env=_clean_env(),
                capture_output=True,
                text=True,
                timeout=TIMEOUT_S,
            )
        except subprocess.TimeoutExpired:
            print(f"readme quickstart: FAILED, not done within {TIMEOUT_S} s", file=sys.stderr)
            return 1
        total, ended = time.monotonic() - started, time.time()
    if proc.returncode != 0:
        print(proc.stdout[-3000:] + proc.stderr[-3000:], file=sys.stderr)
        print(f"readme quickstart: FAILED, exit {proc.returncode}", file=sys.stderr)
        return 1
    try:
        rows = demo_rows(proc.stdout)
    except StopIteration:
        print(proc.stdout[-3000:], file=sys.stderr)
        print("readme quickstart: FAILED, the demo printed no table", file=sys.stderr)
        return 1
    served = [row for row in rows if "push-parallel" in row and row.rstrip().endswith("ms")]
    if len(rows) != DEMO_REQUESTS or len(served) != DEMO_REQUESTS:
        print("\n".join(rows), file=sys.stderr)
        print(
            f"readme quickstart: FAILED, {len(served)} of {DEMO_REQUESTS} requests served "
            "push-parallel",
            file=sys.stderr,
        )
        return 1
    print(
        f"readme quickstart: ok, {len(rows)} requests push-parallel "
        f"({_durations(proc.stderr, ended)}, total {total:.0f} s)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
