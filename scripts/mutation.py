"""Mutation testing of the ext_proc's core modules with mutmut, and a report of what survived.

mutmut copies `extproc/` to `mutants/`, plants one small change ("mutant") at a time in the
modules of `[tool.mutmut] only_mutate` and runs the unit tests (`tests/extproc`) that reach the
mutated function. A mutant the tests do not notice "survived": either the tests miss a
behaviour, or the change makes no observable difference (an "equivalent" mutant, listed with
its reason in `scripts/mutation_equivalent.toml`, as are survivors left on purpose, with
kind = "left"; those still count against the kill rate). The integration tests start Envoy and are
too slow to run once per mutant; `--with-integration` tries only the unit tests' survivors
against the integration tests that reach their function (scripts/mutation_integration.py).

    python scripts/mutation.py                    # run every core module, then report
    python scripts/mutation.py bodies pool        # only these modules (each fully re-run)
    python scripts/mutation.py --set issue38      # a named set of modules (SETS below)
    python scripts/mutation.py --resume           # only mutants without a result yet
    python scripts/mutation.py --survivors        # re-run only what survived last time
    python scripts/mutation.py --timeouts         # re-run only what timed out
    python scripts/mutation.py --report           # no run: report the stored results
    python scripts/mutation.py --time-box 1800    # stop after 30 min; --resume goes on
    python scripts/mutation.py --set issue38 --report --with-integration
                                                  # survivors re-run against integration tests

Results are kept in `mutants/` (git-ignored) between runs. Needs the `mutation` extra
(`pip install -e '.[mutation]'`). One worker process unless `--workers`: mutmut stops a mutant
on CPU time (not wall time), so a starved machine slows the run but does not fake timeouts.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import json
import os
import signal
import subprocess
import sys
import time
import tomllib
from collections import Counter
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path

import mutation_integration

ROOT = Path(__file__).resolve().parents[1]
MUTANTS = ROOT / "mutants"
EQUIVALENT_FILE = ROOT / "scripts" / "mutation_equivalent.toml"

# mutmut's exit codes per mutant (mutmut.stats.status_by_exit_code), grouped for the report.
_STATUS = {
    1: "killed",
    3: "killed",
    0: "survived",
    5: "no_tests",
    33: "no_tests",
    36: "timeout",
    24: "timeout",
    -24: "timeout",
    152: "timeout",
    255: "timeout",
    37: "killed",
    None: "not_checked",
}
# named sets of modules (fnmatch patterns over the dotted names of core_modules())
SETS = {
    # issue 38: the KV-cache routing, the scheduling and the owed pushes
    "issue38": (
        "kvcache.*",
        "policies.kv_cache",
        "scheduling.*",
        "request.strategies",
        "request.pushed_kv",
    ),
}
COLUMNS = (
    "mutants",
    "killed",
    "by_integration",
    "timeout",
    "survived",
    "no_tests",
    "equivalent",
    "other",
    "not_checked",
)


def core_modules() -> list[str]:
    """The modules of pyproject's [tool.mutmut] only_mutate (globs allowed), relative to
    extproc/ and dotted: "protocol.bodies", "policies.prefix"."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mutmut"]
    found = [path for pattern in config["only_mutate"] for path in sorted(ROOT.glob(pattern))]
    return [".".join(path.relative_to(ROOT / "extproc").with_suffix("").parts) for path in found]


def _source(module: str, root: Path = ROOT) -> Path:
    return root.joinpath("extproc", *module.split(".")).with_suffix(".py")


@dataclass(frozen=True)
class Mutant:
    name: str  # mutmut's, e.g. extproc.scheduling.pool.xǁPoolǁpick__mutmut_3
    module: str
    status: str
    function: str  # Class.method or function, as in the source
    line: int  # in the original file
    before: str
    after: str

    @property
    def where(self) -> str:
        return f"{_source(self.module).relative_to(ROOT)}:{self.line}"


def _function_lines(source: str) -> dict[str, int]:
    """'Class.method' or 'function' -> line of its `def` in the original source."""
    found: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                found[prefix + child.name] = child.lineno
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")

    visit(ast.parse(source), "")
    return found


def _readable(mangled: str) -> str:
    """mutmut's mangled name (x_f, xǁClassǁmethod) as Class.method / f."""
    if mangled.startswith("xǁ"):
        return ".".join(mangled[2:].split("ǁ"))
    return mangled.removeprefix("x_")


def _mutant_blocks(path: Path) -> dict[str, list[str]]:
    """mutmut's copies of each function in a mutated file, by name (x_f__mutmut_3, ...)."""
    lines = path.read_text().splitlines()
    return {
        node.name: lines[node.lineno - 1 : node.end_lineno]
        for node in ast.walk(ast.parse("\n".join(lines)))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and "__mutmut_" in node.name
    }


def load_module(module: str) -> list[Mutant]:
    """Every mutant of one module with its status and the line it changes."""
    meta_path = _source(module, MUTANTS).with_suffix(".py.meta")
    if not meta_path.exists():
        return []
    exit_codes = json.loads(meta_path.read_text())["exit_code_by_key"]
    blocks = _mutant_blocks(_source(module, MUTANTS))
    def_lines = _function_lines(_source(module).read_text())
    result = []
    for name, code in sorted(exit_codes.items(), key=lambda kv: _natural(kv[0])):
        # a package's __init__ is named for the package: extproc.policies.x_build_picker
        key = name.removeprefix(f"extproc.{module.removesuffix('.__init__')}.")
        mangled = key.rsplit("__mutmut_", 1)[0]
        offset, before, after = _first_change(blocks[f"{mangled}__mutmut_orig"], blocks[key])
        function = _readable(mangled)
        line = def_lines.get(function, 0) + offset
        status = _STATUS.get(code, "other")
        result.append(Mutant(name, module, status, function, line, before, after))
    return result


def _mutant_glob(module: str) -> str:
    """mutmut's names of a module's mutants; a package's __init__ has the package's name, and
    its functions' mangled names (x_f, xǁClassǁmethod) tell them from its submodules'."""
    if module.endswith(".__init__"):
        return f"extproc.{module.removesuffix('.__init__')}.x*"
    return f"extproc.{module}.*"


def _natural(name: str) -> tuple[str, int]:
    head, _, number = name.rpartition("__mutmut_")
    return head, int(number) if number.isdigit() else 0


def _first_change(orig: list[str], variant: list[str]) -> tuple[int, str, str]:
    """(offset from the def line, original text, mutated text) of the first changed lines."""
    name = variant[0].split("def ", 1)[1].split("(", 1)[0]
    original_name = name.rsplit("__mutmut_", 1)[0] + "__mutmut_orig"
    variant = [variant[0].replace(name + "(", original_name + "(", 1), *variant[1:]]
    matcher = difflib.SequenceMatcher(a=orig, b=variant, autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag != "equal":
            before = " ".join(line.strip() for line in orig[i1:i2])
            after = " ".join(line.strip() for line in variant[j1:j2])
            return i1, _plain(before, original_name), _plain(after, original_name)
    return 0, "", ""


def _plain(text: str, mangled: str) -> str:
    """A def line as written in the source (mutmut's copy has a mangled name)."""
    readable = _readable(mangled.removesuffix("__mutmut_orig")).rsplit(".", 1)[-1]
    return text.replace(mangled + "(", readable + "(")


def load_equivalent() -> list[dict[str, str]]:
    if not EQUIVALENT_FILE.exists():
        return []
    return tomllib.loads(EQUIVALENT_FILE.read_text())["equivalent"]


def explanation(mutant: Mutant, known: list[dict[str, str]]) -> dict[str, str] | None:
    """The recorded entry for this survivor (matched by module, function and text), if any."""
    for entry in known:
        if (entry["module"], entry["function"], entry["before"], entry["after"]) == (
            mutant.module,
            mutant.function,
            mutant.before,
            mutant.after,
        ):
            return entry
    return None


def run_mutmut(names: list[str], time_box: float | None, workers: int = 1) -> None:
    """`mutmut run`; named mutants (globs) are re-run even if they have results."""
    command = [sys.executable, "-m", "mutmut", "run", "--max-children", str(workers), *names]
    print("$", " ".join(command), flush=True)
    started = time.monotonic()
    with subprocess.Popen(
        command, cwd=ROOT, start_new_session=True, stdout=subprocess.DEVNULL
    ) as process:
        try:
            process.wait(timeout=time_box)
        except subprocess.TimeoutExpired:
            print(f"time box of {time_box:g} s reached: stopping (--resume goes on)", flush=True)
            os.killpg(process.pid, signal.SIGINT)  # mutmut saves what it has and stops
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
    print(f"mutmut finished in {time.monotonic() - started:.0f} s (exit {process.returncode})")


def _after_integration(mutant: Mutant, integration: dict[str, dict[str, str]]) -> str:
    """A unit-test survivor's status once re-checked against the integration tests."""
    found = integration.get(mutant.name)
    if found is None or found["after"] != mutant.after:
        return mutant.status
    return {"killed": "by_integration", "timeout": "timeout"}.get(found["status"], mutant.status)


def report(modules: list[str], markdown: bool = False) -> int:
    known = load_equivalent()
    integration = mutation_integration.load_results()
    rows: dict[str, Counter[str]] = {}
    survivors: list[tuple[Mutant, dict[str, str] | None]] = []
    for module in modules:
        counts: Counter[str] = Counter()
        for mutant in load_module(module):
            counts["mutants"] += 1
            status = mutant.status
            if status in ("survived", "no_tests"):
                entry = explanation(mutant, known)
                if entry is not None and entry.get("kind", "equivalent") == "equivalent":
                    status = "equivalent"  # an integration test failing on it was a flake
                else:
                    status = _after_integration(mutant, integration)
            if status in ("survived", "no_tests", "equivalent"):
                survivors.append((mutant, entry))
            if status == "by_integration":
                counts["killed"] += 1
            counts[status] += 1
        rows[module] = counts
    rows["TOTAL"] = sum(rows.values(), Counter())
    if markdown:
        _markdown(rows)
    print()
    width = max(len(module) for module in rows) + 2
    print(f"{'module':<{width}}" + "".join(f"{c:>15}" for c in COLUMNS) + f"{'kill rate':>12}")
    for module, counts in rows.items():
        print(f"{module:<{width}}" + "".join(f"{counts[c]:>15}" for c in COLUMNS) + _rate(counts))
    print("\nkill rate = (killed + timeout) / (mutants - equivalent - not checked)")
    print("killed counts the unit tests' survivors the integration tests killed (by_integration)")
    unexplained = sum(entry is None for _, entry in survivors)
    print(f"\nSurvivors (file:line  function  original -> mutated), {unexplained} unexplained:")
    for mutant, entry in survivors:
        tag = mutant.status.replace("_", " ")
        if entry is not None:
            tag = f"{entry.get('kind', 'equivalent')}: {entry['reason']}"
        print(f"  {mutant.where:<28} {mutant.function:<26} [{tag}]")
        print(f"      - {mutant.before}\n      + {mutant.after}")
    return 0


def _markdown(rows: dict[str, Counter[str]]) -> None:
    """The table as docs/development.md shows it (killed counts those by_integration)."""
    shown = ("mutants", "killed", "timeout", "survived", "no_tests", "equivalent", "not_checked")
    print("| module | " + " | ".join(c.replace("_", " ") for c in shown) + " | score |")
    print("|---|" + "---:|" * (len(shown) + 1))
    for module, counts in rows.items():
        if not counts["mutants"]:
            continue
        name = "**all**" if module == "TOTAL" else f"`{module}`"
        cells = " | ".join(str(counts[c]) for c in shown)
        print(f"| {name} | {cells} | {_rate(counts).strip()} |")


def _rate(counts: Counter[str]) -> str:
    relevant = counts["mutants"] - counts["equivalent"] - counts["not_checked"]
    if relevant == 0:
        return f"{'-':>12}"
    return f"{100 * (counts['killed'] + counts['timeout']) / relevant:>11.1f}%"


def _modules(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    core = core_modules()
    if args.set:
        return [m for m in core if any(fnmatch(m, pattern) for pattern in SETS[args.set])]
    unknown = set(args.modules) - set(core)
    if unknown:
        parser.error(f"not a core module: {', '.join(sorted(unknown))}")
    return args.modules or core


def _own_unit_tests(module: str) -> list[str]:
    """tests/extproc/<folder>/test_<module>*.py, the unit tests of one module."""
    *folders, name = module.split(".")
    folder = ROOT.joinpath("tests", "extproc", *folders)
    return [str(path.relative_to(ROOT)) for path in sorted(folder.glob(f"test_{name}*.py"))]


def _names(modules: list[str], statuses: tuple[str, ...]) -> list[str]:
    return [m.name for module in modules for m in load_module(module) if m.status in statuses]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("modules", nargs="*", help="core modules to run (default: all)")
    parser.add_argument("--set", choices=sorted(SETS), help="a named set of modules instead")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--report", action="store_true", help="no run, report stored results")
    group.add_argument("--resume", action="store_true", help="only mutants without a result")
    group.add_argument("--survivors", action="store_true", help="re-run only the survivors")
    group.add_argument("--timeouts", action="store_true", help="re-run only the timeouts")
    parser.add_argument("--time-box", type=float, help="stop mutmut after this many seconds")
    parser.add_argument("--workers", type=int, default=1, help="mutmut's worker processes")
    parser.add_argument("--markdown", action="store_true", help="the table as markdown too")
    parser.add_argument(
        "--with-integration",
        action="store_true",
        help="then re-check the survivors against the integration tests that reach them",
    )
    parser.add_argument(
        "--integration-tests",
        type=int,
        default=mutation_integration.MOST_TESTS,
        help="at most this many integration tests per survivor, the quickest reaching it",
    )
    args = parser.parse_args()
    if args.set and args.modules:
        parser.error("give modules or --set, not both")
    modules = _modules(parser, args)
    names: list[str] = []
    if args.resume:
        names = _names(modules, ("not_checked",))
    elif args.survivors:
        names = _names(modules, ("survived", "no_tests", "not_checked"))
    elif args.timeouts:
        names = _names(modules, ("timeout",))
    elif not args.report:
        names = [_mutant_glob(module) for module in modules]
    if names:
        run_mutmut(names, args.time_box, args.workers)
    if args.with_integration:
        survivors = [
            (
                m.name,
                m.after,
                [
                    *(_own_unit_tests(module) if m.status == "no_tests" else []),
                    *mutation_integration.driving(module),
                ],
            )
            for module in modules
            for m in load_module(module)
            if m.status in ("survived", "no_tests")
        ]
        files = mutation_integration.integration_files()
        mutation_integration.recheck(survivors, files, args.integration_tests, args.time_box)
    return report(modules, args.markdown)


if __name__ == "__main__":
    sys.exit(main())
