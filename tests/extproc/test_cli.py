"""The command line: flags in either place, --version, one rule for the prefill listener."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from extproc.cli import main


def write_config(tmp_path: Path, **envoy: object) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "prefill": {"endpoints": ["127.0.0.1:8100"]},
                "decode": {"endpoints": ["127.0.0.1:8200"]},
                "envoy": envoy,
            }
        )
    )
    return path


def prefill_listener_port(rendered: str) -> int:
    bootstrap = yaml.safe_load(rendered)
    listener = next(x for x in bootstrap["static_resources"]["listeners"] if x["name"] == "prefill")
    return int(listener["address"]["socket_address"]["port_value"])


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.startswith("pd-extproc 0.")


@pytest.mark.parametrize("position", ["before", "after"])
def test_log_level_is_accepted_before_or_after_the_command(
    tmp_path: Path, position: str, capsys: pytest.CaptureFixture[str]
) -> None:
    command = ["render-envoy", "--config", str(write_config(tmp_path))]
    flag = ["--log-level", "debug"]
    assert main(flag + command if position == "before" else command + flag) == 0
    assert "static_resources" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("in_config", "flag", "port"),
    [
        ("", None, 10001),
        ("127.0.0.1:10555", None, 10555),
        ("127.0.0.1:10555", "127.0.0.1:10777", 10777),
    ],
)
def test_render_envoy_takes_the_prefill_listener_from_flag_then_config_then_default(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], in_config: str, flag: str | None, port: int
) -> None:
    argv = ["render-envoy", "--config", str(write_config(tmp_path, prefill_listener=in_config))]
    assert main(argv + (["--prefill-listener", flag] if flag else [])) == 0
    assert prefill_listener_port(capsys.readouterr().out) == port


def test_a_prefill_listener_off_loopback_is_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["render-envoy", "--config", str(write_config(tmp_path))]
    assert main([*argv, "--prefill-listener", "10.1.2.3:10001"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        err[-1] == "--prefill-listener 10.1.2.3:10001: must be a loopback address or "
        "unix:/path (it has no auth)"
    )


def test_a_bogus_log_level_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--log-level", "bogus", "render-envoy", "--config", str(write_config(tmp_path))]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "pd-extproc: --log-level bogus: one of DEBUG, INFO, WARNING, ERROR, CRITICAL (any case)"
    ]


def test_a_socket_in_a_missing_directory_is_not_reported_as_in_use(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_config(tmp_path)
    config = yaml.safe_load(path.read_text())
    socket = tmp_path / "absent" / "extproc.sock"
    config |= {"extproc": {"host": f"unix:{socket}"}, "metrics": {"port": 0}}
    path.write_text(yaml.safe_dump(config))
    assert main(["serve", "--config", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (
        f"extproc.host: unix:{socket}: the directory {socket.parent} does not exist; "
        "create it or choose another path"
    ), err


def test_serve_refuses_eds_and_the_access_log_off_loopback_without_mtls(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_config(tmp_path)
    config = yaml.safe_load(path.read_text())
    config |= {"extproc": {"host": "0.0.0.0", "port": 0}, "metrics": {"port": 0}}
    path.write_text(yaml.safe_dump(config))
    assert main(["serve", "--config", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(
        "extproc.host 0.0.0.0: the pools' EDS and the access-log service, which check no "
        "client, would listen there too"
    ), err


def test_pythons_other_level_names_still_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--log-level", "warn", "render-envoy", "--config", str(write_config(tmp_path))]
    assert main(argv) == 0
