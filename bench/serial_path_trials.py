"""Candidate mechanisms for PR #187's serial path, tried on the lab (bench/pr187.py's plan).

From C = 1 to 8 the PR's serial modes slow down far more than parallel push: serial push -
pull goes from -1 to +25 ms and stays +22-35 ms at C = 32 and 128, while the `gpu-8b` model
keeps it at 2-9 ms. Each trial below switches one candidate on, beside the unchanged profile,
in the same run, and prints both gaps against the PR's. None is kept in the simulator: a
trial is only worth modelling if it moves the gaps toward the PR's without breaking the rest.

- `cache_aware`: vllm-router's default policy instead of round robin. With random prompts it
  sends a prompt back to the engine that holds it (the warm-ups' prompt) and every other one
  to the engine with the smallest radix tree. It is vllm-router's, not pd-extproc's: a picker
  of this module (`CacheAwarePicker`) takes the place of the sidecar's on both roles.
- `post_X`: NIXL's transfer post (building and posting the descriptors) costs X ms of CPU per
  1024-token transfer on the thread that posts it: in pull, D's model thread posts its READs
  before the step's forward, one request after another, so the step is longer by them all;
  in push, P's writer thread posts one WRITE after another, off the steps. vllm#35264 gives
  push's lead over pull under load mostly to taking that post off D's forward path.
- `async_scheduling`: vLLM's default engine loop schedules the next step while the device
  runs the current one, so what becomes schedulable while an engine steps (a new request, KV
  seen done) joins the step after next: one step later than the simulator's synchronous loop,
  on P (a prefill step) and on D (a decode step).
- `busy_listener_G`: the push side channel of the revision of vllm#35264 that PR #187 ran
  (before its merge): D's scheduler registers its blocks with a blocking request to a
  listener thread in P's engine-core process. Here that listener waits G ms for the GIL
  whenever P is in a step (Python's thread switch interval is 5 ms).
- `busy_hops_G`: as above, and the WRITE that follows goes through two more threads of that
  process (the push dispatcher, then the worker's trigger listener), each waiting G ms on a
  busy P. This applies to parallel push as well.

    python bench/serial_path_trials.py            # C = 1, 8, 32, 128; ~2 min
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import pr187
from bench.pr187 import ROWS
from extproc.policies import PickRequest
from extproc.policies.base import E
from extproc.roles import Role
from lab.run import Session
from vllmsim.config import CostModel
from vllmsim.cost_model import Fifo
from vllmsim.engine import Engine
from vllmsim.nixl.pull import PullConnector
from vllmsim.nixl.push import PushConnector
from vllmsim.profiles import GPU_8B

RESULTS = Path(__file__).resolve().parent / "results" / "serial-path-trials.md"


class CacheAwarePicker:
    """vllm-router's cache_aware with prompts that share nothing: a prompt returns to the
    engine whose tree holds it, else goes to the one with the smallest tree, which it grows.
    A prompt is known by its start (`PickRequest.prefix`: random prompts differ there)."""

    def __init__(self) -> None:
        self._trees: dict[str, set[bytes]] = {}

    def pick(self, candidates: Sequence[E], request: PickRequest) -> E:
        trees = [self._trees.setdefault(c.address, set()) for c in candidates]
        key = request.prefix
        held = next((i for i, tree in enumerate(trees) if key in tree), None)
        if held is not None:
            return candidates[held]
        smallest = min(range(len(trees)), key=lambda i: len(trees[i]))
        trees[smallest].add(key)
        return candidates[smallest]


def _cache_aware_pickers(lab: Session) -> None:
    for sidecar in lab.sidecars:
        for group in sidecar.scheduler.groups.values():
            for role in (Role.PREFILL, Role.DECODE):
                group.pickers[role] = CacheAwarePicker()


@contextlib.contextmanager
def _patched(*patches: tuple[Any, str, Any]) -> Iterator[None]:
    """Set each (object, attribute, value) for the block, then put every original back."""
    originals = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    try:
        for obj, name, value in patches:
            setattr(obj, name, value)
        yield
    finally:
        for obj, name, original in originals:
            setattr(obj, name, original)


@contextlib.contextmanager
def cache_aware() -> Iterator[None]:
    with _patched((pr187, "PREPARE", _cache_aware_pickers)):
        yield


@contextlib.contextmanager
def busy_p(gil_s: float, hops: int) -> Iterator[None]:
    """P's side-channel listener (and `hops` more threads before the WRITE) wait `gil_s` for
    the GIL while P is in a step."""
    handle, write = PushConnector.handle, PushConnector._write

    async def late_handle(self: PushConnector, msg: dict[str, Any]) -> dict[str, Any]:
        if msg.get("type") == "push_reg" and self.engine._in_step:
            await asyncio.sleep(gil_s)
        return await handle(self, msg)

    async def late_write(self: PushConnector, lease: Any, reg: Any) -> None:
        if hops and self.engine._in_step:
            await asyncio.sleep(hops * gil_s)
        await write(self, lease, reg)

    with _patched((PushConnector, "handle", late_handle), (PushConnector, "_write", late_write)):
        yield


@contextlib.contextmanager
def post_cost(seconds: float) -> Iterator[None]:
    """`seconds` of posting per READ on D's model thread (pull), per WRITE on P's writer
    thread (push)."""
    start_recv, start_step, end_step = (
        PullConnector.start_recv,
        PullConnector.start_step,
        PullConnector.end_step,
    )
    has_work, write = PullConnector.has_pending_work, PushConnector._write
    posting: dict[PullConnector, float] = {}
    costs: dict[PullConnector, CostModel] = {}
    writers: dict[PushConnector, Fifo] = {}
    delays: dict[Any, float] = {}

    def post_then_recv(self: PullConnector, req: Any) -> None:
        posting[self] = posting.get(self, 0.0) + seconds
        delays[req] = posting[self]  # this READ goes once the posts before it are done
        start_recv(self, req)

    def longer_step(self: PullConnector) -> None:  # the step about to run posts the READs
        if self not in costs and (extra := posting.pop(self, 0.0)) > 0:
            costs[self] = cost = self.engine.cost
            self.engine.cost = dataclasses.replace(
                cost,
                step_base_ms=cost.step_base_ms + 1e3 * extra,
                idle_step_ms=cost.idle_step_ms + 1e3 * extra,
            )
        start_step(self)

    def restore(self: PullConnector) -> set[Any]:
        if self in costs:
            self.engine.cost = costs.pop(self)
        return end_step(self)

    async def late_read(self: PullConnector, req: Any) -> None:
        await asyncio.sleep(delays.pop(req, 0.0))
        await _recv(self, req)

    async def posted_write(self: PushConnector, lease: Any, reg: Any) -> None:
        fifo = writers.setdefault(self, Fifo())
        await asyncio.sleep(fifo.take(seconds, asyncio.get_running_loop().time()))
        await write(self, lease, reg)

    _recv = PullConnector._recv
    with _patched(
        (PullConnector, "start_recv", post_then_recv),
        (PullConnector, "start_step", longer_step),
        (PullConnector, "end_step", restore),
        (
            PullConnector,
            "has_pending_work",
            lambda self: has_work(self) or self in posting or self in costs,
        ),
        (PullConnector, "_recv", late_read),
        (PushConnector, "_write", posted_write),
    ):
        yield


@contextlib.contextmanager
def async_scheduling() -> Iterator[None]:
    """The scheduler works one step ahead of the device: what becomes schedulable while the
    engine steps (a new request, KV seen done) joins the step after next."""
    admit, kv_ready, plan, must_step = (
        Engine._admit,
        Engine.kv_ready,
        Engine._plan,
        Engine._must_step,
    )
    eligible: dict[Any, int] = {}  # request -> the first step it may run in

    def lag(engine: Engine) -> int:
        return 2 if engine._step_end is not None else 1  # stepping: the next step is set

    def late_admit(self: Engine) -> None:
        before = set(self.running)
        admit(self)
        for req in self.running:
            if req not in before:
                eligible[req] = self.steps + lag(self)

    def late_ready(self: Engine, req: Any) -> None:
        kv_ready(self, req)
        if req in self.running:
            eligible[req] = self.steps + lag(self)

    def held(self: Engine) -> list[Any]:
        return [r for r in self.running if eligible.get(r, 0) > self.steps + 1]

    def plan_ahead(self: Engine) -> Any:
        waiting = held(self)
        if not waiting:
            return plan(self)
        running = self.running
        self.running = [r for r in running if r not in waiting]
        try:
            return plan(self)
        finally:
            self.running = running

    with _patched(
        (Engine, "_admit", late_admit),
        (Engine, "kv_ready", late_ready),
        (Engine, "_plan", plan_ahead),
        (Engine, "_must_step", lambda self: must_step(self) or bool(held(self))),
    ):
        yield


def trials() -> dict[str, Callable[[], contextlib.AbstractContextManager[None]]]:
    return {
        "profile as fitted": contextlib.nullcontext,
        "cache_aware": cache_aware,
        "post_4": lambda: post_cost(0.004),
        "post_8": lambda: post_cost(0.008),
        "async_scheduling": async_scheduling,
        "busy_listener_5": lambda: busy_p(0.005, 0),
        "busy_listener_10": lambda: busy_p(0.010, 0),
        "busy_hops_5": lambda: busy_p(0.005, 2),
    }


def _gaps(row: dict[str, float]) -> str:
    return f"{row['serial_push'] - row['pull']:+.0f} / {row['pull'] - row['push']:+.0f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--only", nargs="+", help="trials to run (default: every one)")
    args = parser.parse_args()
    cs = tuple(args.concurrency)
    lines = [
        "# PR #187's serial path: candidate mechanisms on the virtual clock",
        "",
        "`python bench/serial_path_trials.py`. Cells: pull / serial push / push mean TTFT (ms),"
        " then serial push - pull / pull - push (ms). PR #187's row first.",
        "",
        "| trial | " + " | ".join(f"C = {c}" for c in cs) + " |",
        "|---|" + "---|" * len(cs),
        "| PR #187 | " + " | ".join(_cell(ROWS[c]) if c in ROWS else "" for c in cs) + " |",
    ]
    for name, switch in trials().items():
        if args.only and name not in args.only and name != "profile as fitted":
            continue
        with switch():
            rows = pr187.table(GPU_8B, cs)
        lines.append(f"| {name} | " + " | ".join(_cell(rows[c]) for c in cs) + " |")
        print(lines[-1], flush=True)
    print("\n".join(lines))
    if not args.only:  # the results file holds every trial
        RESULTS.write_text("\n".join(lines) + "\n")
        print(f"wrote {RESULTS}")


def _cell(row: dict[str, float]) -> str:
    return f"{row['pull']:.0f} / {row['serial_push']:.0f} / {row['push']:.0f}; {_gaps(row)}"


if __name__ == "__main__":
    main()
