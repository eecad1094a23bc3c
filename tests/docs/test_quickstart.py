"""The README's quick start, as `scripts/readme_quickstart.py` (a `.ci/run` step) runs it.

The full run (a fresh clone, a venv, the install, the demo) takes about a minute, so it is a
CI step and not part of the fast suite; these checks keep its reading of the README honest.
"""

from __future__ import annotations

from pathlib import Path

from scripts.readme_quickstart import DEMO_FLAGS, demo_rows, quickstart_commands, runnable

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def test_it_starts_from_git_clone_with_no_extra() -> None:
    commands = quickstart_commands(README)
    assert commands[0].startswith("git clone ") and commands[1].startswith("cd ")
    assert commands[0].split()[-1] == commands[1].split()[-1]  # cd into what was cloned
    installs = [c for c in commands if "pip install" in c]
    # the demo needs nothing beyond the package: no extra, and never the tests' one
    assert len(installs) == 1 and installs[0].endswith("pip install -e .")
    assert commands[-1] == "pd-extproc demo"


def test_it_is_run_on_this_checkout_and_exits_after_the_table() -> None:
    commands = runnable(quickstart_commands(README), ROOT)
    assert commands[0] == f"git clone {ROOT} pd-extproc"
    assert commands[-1] == "pd-extproc demo" + DEMO_FLAGS
    assert "`pd-extproc demo --once`" in README and "`--port 0`" in README  # as the README says


def test_the_readme_sample_table_reads_as_rows() -> None:
    sample = README[README.index("req  prefill  decode") :]
    rows = demo_rows(sample[: sample.index("```")])
    # the demo's own output, whole: its default --requests is 6
    assert len(rows) == 6 and all("push-parallel" in row for row in rows)


def test_ci_runs_it() -> None:
    assert "python scripts/readme_quickstart.py" in (ROOT / ".ci/run").read_text()
