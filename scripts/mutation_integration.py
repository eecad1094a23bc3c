"""Re-check mutmut's survivors against the integration tests that reach the mutated function.

mutmut runs only the unit tests: the integration tests start Envoy and are too slow to run for
every mutant. A survivor of the unit tests is tried here against the integration tests
(`tests/integration`, `tests/epp`) that call its function, found by one run of those tests in
mutmut's "stats" mode (which records the functions each test reaches; kept in
`mutants/integration_hits.json`). Each survivor then runs those tests with `-x`; a failing test
counts as a kill only if it passes again without the mutant (a test that fails either way says
nothing about the mutant). Most integration tests run the sidecar in a child process, whose
calls the stats run cannot see: a survivor also runs the integration files that drive its
module there (`DRIVING`, found by grep), whole. A mutant no unit test reached ("no tests":
its code may run in a child process, where mutmut does not see it) also runs its module's own
unit tests here.
Results are kept in `mutants/integration_results.json`.

Run by `scripts/mutation.py --with-integration`; `python scripts/mutation_integration.py hits
OUT FILE...` is the stats run itself (a separate process: it imports the mutated copy).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MUTANTS = ROOT / "mutants"
HITS = MUTANTS / "integration_hits.json"
RESULTS = MUTANTS / "integration_results.json"
INTEGRATION_DIRS = ("tests/integration", "tests/epp")
# The sidecar of most integration tests is a child process (extproc.testing), whose calls the
# stats run cannot see: per module (fnmatch, first match), the integration files that drive
# its code there (found by grep: its config keys, its behaviour), run whole for a survivor.
_IT = "tests/integration/test_"
_KV = (f"{_IT}kv_routing.py", f"{_IT}approx_kv_routing.py")
DRIVING = (
    ("kvcache.*", (*_KV, f"{_IT}kv_events_connected.py")),
    ("policies.kv_cache", (*_KV, f"{_IT}data_parallel.py")),
    ("scheduling.decision", (f"{_IT}decide.py",)),
    ("scheduling.admission", (f"{_IT}decide.py", "tests/epp/test_gateway.py")),
    ("scheduling.subset_hint", ("tests/epp/test_gateway.py",)),
    ("scheduling.*", (f"{_IT}policies.py", f"{_IT}dispatch.py")),
    ("request.strategies", (f"{_IT}dispatch.py", f"{_IT}failures.py")),
    ("request.pushed_kv", (f"{_IT}failures.py", f"{_IT}data_parallel.py")),
)
# a mutant that hangs the tests: stopped after this, counted as a timeout
_MIN_TIMEOUT_S = 120.0
_FILE_TIMEOUT_S = 600.0  # more per whole file run (a loaded machine)
MOST_TESTS = 8  # integration tests per mutant, the quickest of those reaching it
_FAILED = re.compile(r"^FAILED (\S+?)(?: - .*)?$", re.MULTILINE)


def driving(module: str) -> list[str]:
    """The integration files that drive `module`'s code in the sidecar's process."""
    return next((list(files) for pattern, files in DRIVING if fnmatch(module, pattern)), [])


def integration_files() -> list[str]:
    return sorted(
        str(path.relative_to(ROOT))
        for folder in INTEGRATION_DIRS
        for path in (ROOT / folder).glob("test_*.py")
    )


def _pytest_env(mutant: str) -> dict[str, str]:
    return {**os.environ, "MUTANT_UNDER_TEST": mutant, "PYTHONDONTWRITEBYTECODE": "1"}


def hits(files: list[str]) -> dict[str, dict[str, Any]]:
    """{mangled function: {test id: seconds}} of the integration tests, run once and kept."""
    if HITS.exists():
        stored = json.loads(HITS.read_text())
        if stored["files"] == files:
            return dict(stored["hits"])
    print(f"recording which integration tests reach which function ({len(files)} files)")
    started = time.monotonic()
    subprocess.run(
        [sys.executable, str(Path(__file__)), "hits", str(HITS), *files],
        cwd=MUTANTS,
        env=_pytest_env("stats"),
        check=False,
    )
    print(f"recorded in {time.monotonic() - started:.0f} s")
    return dict(json.loads(HITS.read_text())["hits"])


def _record_hits(out: Path, files: list[str]) -> int:
    """In mutants/ with MUTANT_UNDER_TEST=stats: run the files, keep each passing test's hits."""
    sys.path.insert(0, str(MUTANTS))
    import pytest
    from mutmut.state import state

    found: dict[str, dict[str, float]] = {}
    seconds: dict[str, float] = {}

    class Collector:
        def pytest_runtest_logreport(self, report: Any) -> None:
            # only a test that passes unmutated can tell a mutant
            if report.when == "call" and report.passed:
                seconds[report.nodeid] = report.duration

        def pytest_runtest_logfinish(self, nodeid: str) -> None:
            # setup, call and teardown of this test (a module fixture's set-up counts for
            # the module's first test, which is the one that runs it)
            reached = set(state()._stats)
            state()._stats.clear()
            if nodeid in seconds:
                for function in reached:
                    found.setdefault(function, {})[nodeid] = seconds[nodeid]

    command = ["--rootdir=.", "-q", "-p", "no:randomly", *files]
    code = pytest.main(command, plugins=[Collector()])
    hits_by_function = found
    out.write_text(json.dumps({"files": files, "hits": hits_by_function}, indent=1))
    return int(code)


def mangled(mutant: str) -> str:
    """mutmut's name of a mutant's function, as the stats run records it."""
    return mutant.rsplit("__mutmut_", 1)[0].replace("__init__.", "")


def load_results() -> dict[str, dict[str, Any]]:
    return dict(json.loads(RESULTS.read_text())) if RESULTS.exists() else {}


def recheck(
    mutants: list[tuple[str, str, list[str]]],
    files: list[str],
    most: int = MOST_TESTS,
    time_box: float | None = None,
) -> None:
    """Run each survivor (name, mutated text, tests to add) against the integration tests
    reaching its function (the `most` quickest: a function every request calls is reached
    by nearly all of them) and the tests added (for a mutant no unit test reached in
    mutmut's process, its module's own unit tests: their code may run in a child process)."""
    reach = hits(files)
    results = load_results()
    stop = None if time_box is None else time.monotonic() + time_box
    for done, (name, after, added) in enumerate(mutants, 1):
        if stop is not None and time.monotonic() > stop:
            print(f"time box reached: {len(mutants) - done + 1} survivors left for a next run")
            return
        previous = results.get(name)
        if previous is not None and previous["after"] == after:
            continue
        reaching = reach.get(mangled(name), {})
        quickest = sorted(reaching, key=lambda test: (reaching[test], test))[:most]
        seconds = {**dict.fromkeys(added, 0.0), **{test: reaching[test] for test in quickest}}
        timeout = max(_MIN_TIMEOUT_S, 10 * sum(seconds.values())) + _FILE_TIMEOUT_S * len(added)
        results[name] = {"after": after, **_try(name, sorted(seconds), timeout)}
        RESULTS.write_text(json.dumps(results, indent=1))
        print(f"  [{done}/{len(mutants)}] {name}: {results[name]['status']}", flush=True)


def _try(name: str, tests: list[str], timeout: float) -> dict[str, Any]:
    if not tests:
        return {"status": "unreached", "tests": 0}
    outcome = _pytest(name, tests, timeout)
    if outcome is None:
        return {"status": "timeout", "tests": len(tests)}
    failed = outcome
    if not failed:
        return {"status": "survived", "tests": len(tests)}
    # a kill counts only if the failing test passes without the mutant
    clean = _pytest("", failed, timeout)
    if clean:
        return {"status": "flaky", "tests": len(tests), "failed": failed}
    return {"status": "killed", "tests": len(tests), "failed": failed}


def _pytest(mutant: str, tests: list[str], timeout: float) -> list[str] | None:
    """The tests that failed (stopping at the first), or None if the run timed out."""
    command = [sys.executable, "-m", "pytest", "--rootdir=.", "-x", "-q", "-rf"]
    try:
        run = subprocess.run(
            [*command, "-p", "no:randomly", "-p", "no:cacheprovider", *tests],
            cwd=MUTANTS,
            env=_pytest_env(mutant),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return None
    if run.returncode == 0:
        return []
    failed = _FAILED.findall(run.stdout)
    return failed or [f"(pytest exit {run.returncode})"]


if __name__ == "__main__":
    if sys.argv[1:2] == ["hits"]:
        sys.exit(_record_hits(Path(sys.argv[2]), sys.argv[3:]))
    sys.exit(f"usage: {sys.argv[0]} hits OUT FILE...  (run by scripts/mutation.py)")
