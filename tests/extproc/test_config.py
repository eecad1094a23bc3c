from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from extproc.bootstrap.render import render_bootstrap, render_yaml
from extproc.config import ConfigError, DispatchMode, parse_config
from extproc.process.envoy_process import envoy_binary
from extproc.roles import Role
from extproc.wiring import Runtime

MINIMAL = {
    "prefill": {"endpoints": ["127.0.0.1:8100"]},
    "decode": {"endpoints": ["127.0.0.1:8200"]},
}


def test_minimal_config_gets_defaults() -> None:
    cfg = parse_config(MINIMAL)
    assert cfg.dispatch.mode is DispatchMode.AUTO and cfg.dispatch.probe
    assert Runtime(cfg, "unix:/x").scheduler.prefill_mode("127.0.0.1:8100") is DispatchMode.AUTO


@pytest.mark.parametrize(
    ("section", "port"),
    [
        ({"extproc": {"host": "0.0.0.0"}}, 50051),
        ({"metrics": {"host": "0.0.0.0"}}, 9464),
        ({"envoy": {"listen": {"host": "0.0.0.0"}}}, 8000),
    ],
)
def test_setting_a_sections_host_keeps_its_documented_port(
    section: dict[str, object], port: int
) -> None:
    # Once, `metrics: {host: 0.0.0.0}` (what docs/deployment.md suggests) gave a random port.
    cfg = parse_config(MINIMAL | section)
    listen = {"extproc": cfg.extproc, "metrics": cfg.metrics, "envoy": cfg.envoy.listen}
    assert listen[next(iter(section))].port == port


def test_per_endpoint_mode() -> None:
    cfg = parse_config(
        MINIMAL
        | {
            "prefill": {
                "endpoints": [{"address": "127.0.0.1:8100", "mode": "pull"}, "127.0.0.1:8101"]
            }
        }
    )
    runtime = Runtime(cfg, "unix:/x")
    assert runtime.scheduler.prefill_mode("127.0.0.1:8100") is DispatchMode.PULL
    assert runtime.scheduler.prefill_mode("127.0.0.1:8101") is DispatchMode.AUTO


def test_data_parallel_size_per_pool_and_per_endpoint() -> None:
    """An endpoint's own value wins over its pool's, even 1 (that server has no ranks);
    members found by discovery take their pool's."""
    cfg = parse_config(
        MINIMAL
        | {
            "prefill": {
                "endpoints": [
                    "127.0.0.1:8100",
                    {"address": "127.0.0.1:8101", "data_parallel_size": 1},
                    {"address": "127.0.0.1:8102", "data_parallel_size": 8},
                ],
                "data_parallel_size": 4,
            }
        }
    )
    scheduler = Runtime(cfg, "unix:/x").scheduler
    sizes = [scheduler.data_parallel_size(Role.PREFILL, f"127.0.0.1:{p}") for p in (8100, 8101)]
    assert sizes == [4, 1]
    assert scheduler.data_parallel_size(Role.PREFILL, "127.0.0.1:8102") == 8
    assert scheduler.data_parallel_size(Role.PREFILL, "10.9.9.9:8000") == 4  # discovered
    assert scheduler.data_parallel_size(Role.DECODE, "127.0.0.1:8200") == 1
    assert scheduler.prefill.ranks_of("127.0.0.1:8100") == 4
    decode = scheduler.decode.get("127.0.0.1:8200")
    assert decode is not None
    decode.rank_load = {0: 0.0, 1: 3.0}  # not configured: its /metrics shows two engines
    assert scheduler.data_parallel_size(Role.DECODE, "127.0.0.1:8200") == 2
    decode.rank_load = {0: 0.0, 2: 3.0}  # not ranks 0 .. N-1: not believed
    assert scheduler.data_parallel_size(Role.DECODE, "127.0.0.1:8200") == 1
    with pytest.raises(ConfigError, match="data_parallel_size: Input should be greater than"):
        parse_config(
            MINIMAL | {"decode": {"endpoints": ["127.0.0.1:8200"], "data_parallel_size": 0}}
        )


def test_every_problem_is_one_line() -> None:
    bad = {
        "prefill": {"endpoints": ["nope", "127.0.0.1:99999"]},
        "decode": {"endpoints": []},
        "dispatch": {"mode": "fast"},
        "typo": 1,
    }
    with pytest.raises(ConfigError) as caught:
        parse_config(bad)
    lines = str(caught.value).splitlines()
    assert any(line.startswith("prefill.endpoints.0.address: not a host:port") for line in lines)
    assert any("65535" in line for line in lines)
    assert "decode: give endpoints, dns, kubernetes or inference_pool" in lines
    assert any(line.startswith("dispatch.mode:") for line in lines)
    assert any(line.startswith("typo:") for line in lines)


def test_endpoints_are_ip_addresses_and_names_go_under_dns() -> None:
    """Envoy's pools refuse a name ("malformed IP address"): say so at the config check."""
    with pytest.raises(ConfigError) as caught:
        parse_config(MINIMAL | {"decode": {"endpoints": ["vllm-d0:8200"]}})
    assert str(caught.value) == (
        "decode.endpoints.0.address: an IP address, not a name (got 'vllm-d0:8200'); "
        "give names with dns: (or kubernetes:)"
    )
    assert parse_config(MINIMAL | {"decode": {"dns": "vllm-d0:8200"}}).decode.dns
    assert parse_config(MINIMAL | {"decode": {"endpoints": ["[::1]:8200"]}})


def test_prefill_listener_must_be_local() -> None:
    with pytest.raises(ConfigError, match="loopback"):
        parse_config(MINIMAL | {"envoy": {"prefill_listener": "0.0.0.0:9000"}})


def test_cli_reports_bad_config_without_traceback(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"prefill": {"endpoints": ["x"]}}))
    result = subprocess.run(
        [sys.executable, "-m", "extproc", "render-envoy", "-c", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "decode: Field required" in result.stderr


@pytest.mark.parametrize("listener", ["unix:/tmp/pd-extproc-test.sock", "127.0.0.1:10001"])
def test_rendered_bootstrap_passes_envoy_validate(tmp_path: Path, listener: str) -> None:
    cfg = parse_config(MINIMAL | {"decode": {"endpoints": ["127.0.0.1:8200", "127.0.0.2:8200"]}})
    path = tmp_path / "envoy.yaml"
    path.write_text(render_yaml(render_bootstrap(cfg, "127.0.0.1:50051", listener)))
    result = subprocess.run(
        [envoy_binary(), "--mode", "validate", "-c", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "OK" in result.stdout + result.stderr


def test_forward_headers_default_to_the_key_and_trace_context() -> None:
    assert parse_config(MINIMAL).dispatch.forward_headers == [
        "authorization",
        "traceparent",
        "tracestate",
    ]
    cfg = parse_config(MINIMAL | {"dispatch": {"forward_headers": ["Authorization", "X-Tenant"]}})
    assert cfg.dispatch.forward_headers == ["authorization", "x-tenant"]


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("Connection", "'connection' is hop-by-hop"),
        ("keep-alive", "hop-by-hop"),
        ("TE", "hop-by-hop"),
        ("trailer", "hop-by-hop"),
        ("transfer-encoding", "hop-by-hop"),
        ("upgrade", "hop-by-hop"),
        ("proxy-authorization", "hop-by-hop"),
        ("host", "set by pd-extproc or Envoy"),
        (":authority", "set by pd-extproc or Envoy"),
        ("content-length", "set by pd-extproc or Envoy"),
        ("x-request-id", "set by pd-extproc or Envoy"),
        ("x-gateway-destination-endpoint", "set by pd-extproc or Envoy"),
        ("X-data-parallel-rank", "set by pd-extproc or Envoy"),
        ("x-envoy-max-retries", "set by pd-extproc or Envoy"),
        ("x-forwarded-for", "set by pd-extproc or Envoy"),
        ("bad header", "not a valid header name"),
    ],
)
def test_forward_headers_refuse_hop_by_hop_and_routing_headers(name: str, why: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config(MINIMAL | {"dispatch": {"forward_headers": ["authorization", name]}})
    [line] = str(caught.value).splitlines()
    assert line.startswith("dispatch.forward_headers: ") and why in line, line


def test_the_engine_priority_header_is_forwarded_only_where_clients_may_set_it() -> None:
    dispatch = {"forward_headers": ["X-Vllm-Priority"]}
    with pytest.raises(ConfigError) as caught:
        parse_config(MINIMAL | {"dispatch": dispatch})
    [line] = str(caught.value).splitlines()
    assert line.startswith("dispatch: ") and "client_engine_priority is true" in line, line
    assert not parse_config(MINIMAL).dispatch.client_engine_priority
    allowed = parse_config(MINIMAL | {"dispatch": dispatch | {"client_engine_priority": True}})
    assert allowed.dispatch.forward_headers == ["x-vllm-priority"]


def test_engine_api_key_is_read_at_load_and_never_shown(tmp_path: Path) -> None:
    assert parse_config(MINIMAL).engines.auth_headers == {}
    key_file = tmp_path / "key"
    key_file.write_text("sk-secret\n")
    cfg = parse_config(MINIMAL | {"engines": {"api_key_file": str(key_file)}})
    assert cfg.engines.auth_headers == {"authorization": "Bearer sk-secret"}
    assert "sk-secret" not in repr(cfg) and "sk-secret" not in str(cfg.model_dump())
    key_file.write_text(" \n")
    with pytest.raises(ConfigError, match=r"^engines: api_key_file .* is empty$"):
        parse_config(MINIMAL | {"engines": {"api_key_file": str(key_file)}})
    with pytest.raises(ConfigError, match=r"^engines: api_key_file .* cannot be read \(No such"):
        parse_config(MINIMAL | {"engines": {"api_key_file": str(tmp_path / "absent")}})
    with pytest.raises(ConfigError, match=r"^engines: api_key_file /dev/zero is larger than"):
        parse_config(MINIMAL | {"engines": {"api_key_file": "/dev/zero"}})  # read with a bound


def test_the_engines_keys_are_one_a_line_and_the_sidecar_sends_the_first(tmp_path: Path) -> None:
    key_file = tmp_path / "keys"
    key_file.write_text("sk-one\n\n  sk-two  \n")
    engines = parse_config(MINIMAL | {"engines": {"api_key_file": str(key_file)}}).engines
    assert engines.api_keys == ("sk-one", "sk-two")
    assert engines.auth_headers == {"authorization": "Bearer sk-one"}
    for bad in ("sk-\x00one\n", "sk-é\n"):
        key_file.write_text(bad)
        with pytest.raises(ConfigError, match=r"a key may hold only printable ASCII characters"):
            parse_config(MINIMAL | {"engines": {"api_key_file": str(key_file)}})


def _message_timeout(cfg_dict: dict) -> str:
    bootstrap = render_bootstrap(parse_config(cfg_dict), "127.0.0.1:50051", "unix:/x")
    hcm = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    [ext_proc] = [f for f in hcm["typed_config"]["http_filters"] if f["name"].endswith("ext_proc")]
    return str(ext_proc["typed_config"]["message_timeout"])


def test_extproc_message_timeout_is_sized_for_a_burst_of_large_bodies() -> None:
    # 12 concurrent 10 MB bodies took up to 6.5 s on a busy 2-vCPU machine; each body's timer
    # runs for about the whole burst (they travel interleaved on one HTTP/2 connection)
    assert _message_timeout(MINIMAL) == "9.9s"
    assert _message_timeout(MINIMAL | {"limits": {"max_body_bytes": 64 * 2**20}}) == "36.8s"
    assert _message_timeout(MINIMAL | {"limits": {"max_body_bytes": 2**20}}) == "1.6s"
    assert _message_timeout(MINIMAL | {"timeouts": {"extproc_message_s": 2}}) == "2s"


def test_extproc_connection_survives_a_burst_of_queued_frames() -> None:
    # 600 concurrent 0.5 MB bodies queued ~20000 HTTP/2 frames to the ext_proc; at Envoy's
    # default flood limit (10000) Envoy closed the connection and 599 of them got 503
    bootstrap = render_bootstrap(parse_config(MINIMAL), "127.0.0.1:50051", "unix:/x")
    [cluster] = [c for c in bootstrap["static_resources"]["clusters"] if c["name"] == "pd_extproc"]
    [options] = cluster["typed_extension_protocol_options"].values()
    http2 = options["explicit_http_config"]["http2_protocol_options"]
    assert http2["max_outbound_frames"] >= 600 * (512 * 1024 // 16384) * 10


def test_the_old_hyphenated_mode_is_accepted_with_a_deprecation_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    cfg = parse_config(MINIMAL | {"dispatch": {"mode": "serial-push"}})
    assert cfg.dispatch.mode is DispatchMode.SERIAL_PUSH
    assert "'serial-push' is deprecated: write 'serial_push'" in caplog.text
    with pytest.raises(ConfigError, match="serial_push"):
        parse_config(MINIMAL | {"dispatch": {"mode": "serial+push"}})


def test_inference_pool_roles_follow_llm_d_by_default() -> None:
    pool = {"inference_pool": {"name": "llama", "namespace": "llm"}}
    cfg = parse_config({"prefill": pool, "decode": pool})
    source = cfg.decode.inference_pool
    assert source is not None and source.role_label == "llm-d.ai/role"

    def takes(role: Role, labels: dict[str, str]) -> bool:
        assert source is not None
        return source.takes(role, labels)

    assert takes(Role.PREFILL, {"llm-d.ai/role": "prefill"})
    assert not takes(Role.PREFILL, {"llm-d.ai/role": "both"})
    assert not takes(Role.PREFILL, {})
    for labels in ({"llm-d.ai/role": "decode"}, {"llm-d.ai/role": "both"}, {}):
        assert takes(Role.DECODE, labels)
    assert not takes(Role.DECODE, {"llm-d.ai/role": "encode"})
    custom = {"inference_pool": {"name": "x", "role_label": "tier", "roles": ["gen"]}}
    source = parse_config({"prefill": pool, "decode": custom}).decode.inference_pool
    assert takes(Role.DECODE, {"tier": "gen"}) and not takes(Role.DECODE, {})


def test_the_old_kv_cache_weight_names_its_replacements() -> None:
    pool = {"endpoints": ["127.0.0.1:8100"], "policy": "kv_cache", "kv_cache_weight": 4}
    with pytest.raises(ConfigError, match="replaced by kv_cached_token_weight"):
        parse_config(MINIMAL | {"prefill": pool})
