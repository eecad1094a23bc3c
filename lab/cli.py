"""`pd-extproc-lab` (or `python -m lab`): configurations side by side on the lab's cluster.

    pd-extproc-lab --topology 2P2D --config a.yaml --config b.yaml \\
        (--trace t.jsonl [--speedup 3] | --workload seed|shared-prefix|multi-turn|mixed
         (--concurrency C | --rate R)) [--workers W] [--replicas R] [--seed 1] --out DIR

A command of its own rather than `pd-extproc lab`: nothing in `extproc` imports the lab (an
import contract in pyproject.toml), so the product's CLI cannot load it.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

from extproc.config import ConfigError
from lab.engines import parse_topology
from lab.report import write
from lab.run import Settings, run_config
from lab.sidecar import PROXIES, ProxyCosts
from lab.tokenizer import TokenizerCosts
from lab.workloads import GENERATORS, TraceError, Workload, generate, read_mooncake
from vllmsim.profiles import DEFAULT_PROFILE, PROFILES

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pd-extproc-lab",
        description="pd-extproc's own scheduling objects, from config files, on vllmsim's "
        "engines on a virtual clock (docs/lab.md)",
    )
    parser.add_argument("--topology", required=True, help="xPyD, e.g. 2P2D")
    parser.add_argument(
        "--config",
        action="append",
        required=True,
        type=Path,
        help="a pd-extproc config file as `up` takes it (repeat to compare); its pools' "
        "members become the lab's engines",
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--trace", type=Path, help="a Mooncake-format JSONL trace (open loop)")
    source.add_argument("--workload", choices=sorted(GENERATORS), help="a generated workload")
    parser.add_argument(
        "--turn-waves",
        action="store_true",
        help="closed loop: turn k of every conversation as one run, turn k + 1 after all of "
        "turn k (bench/cache.py's multi-turn client)",
    )
    parser.add_argument("--speedup", type=float, default=1.0, help="the trace's time divisor")
    parser.add_argument("--trace-limit", type=int, help="replay the trace's first N requests")
    parser.add_argument("--concurrency", type=int, help="closed loop: C clients")
    parser.add_argument("--rate", type=float, help="open loop: requests (chains) per second")
    parser.add_argument("--requests", type=int, help="how many the generator makes")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        help="ext_proc processes per sidecar (extproc.workers), each with its own state",
    )
    parser.add_argument(
        "--replicas", type=int, default=1, help="sidecars the clients spread over in turn"
    )
    parser.add_argument("--profile", choices=sorted(PROFILES), default=DEFAULT_PROFILE)
    parser.add_argument(
        "--max-model-len",
        type=int,
        help="override the profile's (longer requests fail with 400, as vLLM refuses them)",
    )
    parser.add_argument(
        "--prefill-kv-blocks",
        type=int,
        help="every prefill engine's KV cache in blocks (vllmsim --num-gpu-blocks; default: "
        "the profile's): a tight prefill cache, as bench/cache.py's tight regime",
    )
    parser.add_argument(
        "--proxy",
        choices=sorted(PROXIES),
        default="pd-extproc",
        help="whose measured per-request costs the transport adds (bench/results/hotpath.md)",
    )
    parser.add_argument("--proxy-intake-ms", type=float, help="override: client → legs leave")
    parser.add_argument("--proxy-answer-ms", type=float, help="override: on the answer's way")
    parser.add_argument("--proxy-hop-ms", type=float, help="override: proxy ↔ engine, one way")
    parser.add_argument(
        "--per-request",
        action="store_true",
        help="also write each request's diagnostics to DIR/<config>.requests.jsonl and the "
        "requests at or past TTFT p99 to DIR/<config>.tail.md",
    )
    parser.add_argument(
        "--tokenize",
        action="store_true",
        help="send prompts as text that the sidecar tokenizes, its workers' jobs taking "
        "simulated time (lab/tokenizer.py); default: token ids, passed on as they are",
    )
    defaults = TokenizerCosts()
    parser.add_argument(
        "--tokenize-us-per-token",
        type=float,
        default=defaults.us_per_token,
        help="--tokenize: a worker's time per token (default %(default)s)",
    )
    parser.add_argument(
        "--tokenize-workers",
        type=int,
        default=defaults.workers,
        help="--tokenize: the tokenizer's worker processes (default %(default)s)",
    )
    parser.add_argument(
        "--tokenize-max-pending",
        type=int,
        default=defaults.max_pending,
        help="--tokenize: requests waiting for or in a worker at most (default %(default)s)",
    )
    parser.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    parser.add_argument("--slo-tpot-ms", type=float, default=100.0)
    parser.add_argument("--out", type=Path, required=True, help="where summary.json goes")
    return parser


def _workload(args: argparse.Namespace) -> Workload:
    if args.trace is not None:
        if args.concurrency is not None or args.rate is not None:
            raise ValueError("a trace replays at its own times: drop --concurrency/--rate")
        return read_mooncake(args.trace, args.speedup, args.trace_limit)
    return generate(args.workload, args.seed, args.concurrency, args.rate, args.requests)


def _costs(args: argparse.Namespace) -> ProxyCosts:
    base = PROXIES[args.proxy]
    return ProxyCosts(
        base.intake_ms if args.proxy_intake_ms is None else args.proxy_intake_ms,
        base.answer_ms if args.proxy_answer_ms is None else args.proxy_answer_ms,
        base.hop_ms if args.proxy_hop_ms is None else args.proxy_hop_ms,
    )


def _tokenizer(args: argparse.Namespace) -> TokenizerCosts | None:
    if not args.tokenize:
        return None
    if args.tokenize_us_per_token < 0:
        raise ValueError("--tokenize-us-per-token must be at least 0")
    if args.tokenize_workers < 1 or args.tokenize_max_pending < 1:
        raise ValueError("--tokenize-workers and --tokenize-max-pending must be at least 1")
    return TokenizerCosts(
        us_per_token=args.tokenize_us_per_token,
        workers=args.tokenize_workers,
        max_pending=args.tokenize_max_pending,
    )


def _prefill_kv_blocks(blocks: int | None) -> int | None:
    if blocks is not None and blocks < 1:
        raise ValueError("--prefill-kv-blocks must be at least 1")
    return blocks


def _progress(name: str, simulated_s: float, done: int, total: int) -> None:
    """One line rewritten in place on a terminal; a line each time elsewhere."""
    tty = sys.stderr.isatty()
    start = "\r" if tty else ""
    print(
        f"{start}{name}: simulated {simulated_s:.1f} s, {done}/{total} requests",
        end="\n" if done == total or not tty else "",
        file=sys.stderr,
        flush=True,
    )


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    if args.workers < 1 or args.replicas < 1:
        raise ValueError("--workers and --replicas must be at least 1")
    stems = [path.stem for path in args.config]
    if len(set(stems)) != len(stems):
        raise ValueError("two --config files have the same name; the output names them by it")
    workload = _workload(args)
    if args.turn_waves and workload.open_loop:
        raise ValueError(
            "--turn-waves paces a closed loop: give --concurrency, not a rate or trace"
        )
    cost = PROFILES[args.profile]
    if args.max_model_len is not None:
        if args.max_model_len < 1:
            raise ValueError("--max-model-len must be at least 1")
        cost = dataclasses.replace(cost, max_model_len=args.max_model_len)
    settings = Settings(
        parse_topology(args.topology),
        cost,
        _costs(args),
        args.seed,
        args.slo_ttft_ms,
        args.slo_tpot_ms,
        args.workers,
        args.replicas,
        _prefill_kv_blocks(args.prefill_kv_blocks),
        args.turn_waves,
        args.out if args.per_request else None,
        _tokenizer(args),
    )
    configs = [run_config(path, workload, settings, _progress) for path in args.config]
    costs = settings.costs
    meta = {
        "topology": str(settings.topology),
        "profile": args.profile,
        "max_model_len": cost.max_model_len,
        "prefill_kv_blocks": settings.prefill_kv_blocks or cost.num_gpu_blocks,
        "workload": workload.name,
        "requests": workload.requests,
        "seed": args.seed,
        "turn_waves": args.turn_waves,
        "tokenizer": dataclasses.asdict(settings.tokenizer) if settings.tokenizer else None,
        "workers": args.workers,
        "replicas": args.replicas,
        "proxy": {
            "intake_ms": costs.intake_ms,
            "answer_ms": costs.answer_ms,
            "hop_ms": costs.hop_ms,
        },
        "slo_ttft_ms": args.slo_ttft_ms,
        "slo_tpot_ms": args.slo_tpot_ms,
    }
    for path in write(args.out, meta, configs):
        print(path)
    return configs


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    try:
        run(args)
    except (ConfigError, TraceError, ValueError) as error:
        sys.exit(f"pd-extproc-lab: {error}")
