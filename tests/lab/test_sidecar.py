"""The sidecar's side of the lab: what the transport adds, and the background loops' timing."""

from __future__ import annotations

from pathlib import Path

from lab.clock import run_virtual
from lab.configs import lab_config, placeholder_tokenizer
from lab.engines import Cluster, parse_topology
from lab.run import Settings, run_config
from lab.sidecar import ProxyCosts, Sidecar
from lab.workloads import generate
from tests.support.lab import ROUND_ROBIN, config_file
from vllmsim.profiles import PROFILES


def test_the_proxy_costs_add_to_every_requests_ttft(tmp_path: Path) -> None:
    """One request at a time: the engines see the same thing either way."""
    config, seed = config_file(tmp_path, "rr", ROUND_ROBIN), generate("seed", 3, concurrency=1)
    topology, cost = parse_topology("1P1D"), PROFILES["gpu-8b"]
    free = run_config(config, seed, Settings(topology, cost, ProxyCosts(0.0, 0.0, 0.0)))
    paid = run_config(config, seed, Settings(topology, cost, ProxyCosts(10.0, 5.0, 0.0)))
    for q in ("p50", "p90", "p99"):
        assert abs(paid["ttft_ms"][q] - free["ttft_ms"][q] - 15.0) < 1e-6
    assert paid["tpot_ms"] == free["tpot_ms"]


def test_the_engines_load_is_read_at_the_scrapers_intervals(tmp_path: Path) -> None:
    text = """
tokenizer: /models/not-here
prefill: {policy: power_of_two, load_interval_s: 0.5, endpoints: [127.0.0.1:8100]}
decode: {policy: round_robin, kv_events: {port: 5557}, endpoints: [127.0.0.1:8200]}
health: {interval_s: 3}
decision: {mode: off}
"""

    async def intervals() -> dict[str, float]:
        topology = parse_topology("1P1D")
        config = lab_config(
            config_file(tmp_path, "p2", text),
            Cluster.addresses(topology),
            placeholder_tokenizer(tmp_path),
        )
        cluster = Cluster(topology, PROFILES["gpu-8b"], "push", lambda address, batch: None)
        return Sidecar(config, cluster, ProxyCosts()).scrape_intervals()

    # P: its policy reads load every 0.5 s; D: its KV events' pool, at the health interval
    assert run_virtual(intervals) == {"192.0.2.1:8000": 0.5, "198.51.100.1:8000": 3.0}
