"""The wiring: how a reload takes each setting (applied, or reported as needing a restart)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from pydantic import BaseModel

from extproc.config import Config, ConfigError, parse_config
from extproc.protocol.identity import PrefillIdentity
from extproc.roles import Role
from extproc.scheduling.shared_load import SharedLoad
from extproc.wiring import RELOAD, Runtime

P = "127.0.0.1:8100"
MINIMAL = {"prefill": {"endpoints": [P]}, "decode": {"endpoints": ["127.0.0.1:8200"]}}


def _engine(engine_id: str) -> PrefillIdentity:
    return PrefillIdentity(engine_id, "127.0.0.1", 5600, 1, 1, 1, "push")


def test_every_setting_has_a_reload_rule() -> None:
    """A new setting must say how a reload takes it: none is skipped silently."""
    for section, field in Config.model_fields.items():
        assert section in RELOAD, f"{section} has no reload rule"
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            for key in (k for k in RELOAD if k.startswith(section + ".")):
                assert key.partition(".")[2] in annotation.model_fields, f"{key} is stale"


@pytest.mark.parametrize(
    ("change", "reported"),
    [
        ({"tracing": {"enabled": True}}, ["tracing"]),
        ({"log": {"format": "json"}}, ["log.format"]),
        ({"limits": {"max_body_bytes": 1024}}, ["limits.max_body_bytes"]),
        ({"limits": {"max_body_bytes_in_flight": 2**30}, "timeouts": {"upload_s": 5}}, []),
        ({"timeouts": {"prefill_s": 5, "request_s": 10}}, ["timeouts.prefill_s"]),
        ({"log": {"requests": True}, "kv_check": {"enabled": False}}, []),
        ({"discovery": {"interval_s": 1}, "dispatch": {"flap_threshold": 5}}, []),
    ],
    ids=[
        "tracing",
        "log-format",
        "limits",
        "body-budget",
        "envoy-timeout",
        "log-requests",
        "dispatch",
    ],
)
def test_reload_reports_what_needs_a_restart(
    change: dict[str, object], reported: list[str]
) -> None:
    runtime = Runtime(parse_config(MINIMAL), "unix:/x")
    assert runtime.reload(parse_config(MINIMAL | change)) == reported


def test_reload_applies_the_identity_flap_settings() -> None:
    runtime = Runtime(parse_config(MINIMAL | {"dispatch": {"flap_threshold": 2}}), "unix:/x")
    runtime.reload(parse_config(MINIMAL | {"dispatch": {"flap_threshold": 5}}))
    for engine_id in ("a", "b", "a"):  # two changes: flapping under 2, not under 5
        runtime.identities.learn(P, _engine(engine_id))
    assert not runtime.identities.serial_only(P)


def test_a_prefills_context_length_goes_to_its_model_group() -> None:
    group = {
        "prefill": {"endpoints": ["127.0.0.1:8102"]},
        "decode": {"endpoints": ["127.0.0.1:8202"]},
    }
    config = {
        "prefill": {"endpoints": ["127.0.0.1:8101"]},
        "decode": {"endpoints": ["127.0.0.1:8201"]},
        "models": {"big": group},
    }
    runtime = Runtime(parse_config(config), "unix:/x")
    runtime._context_length("127.0.0.1:8102", 32768)  # what the probe read from /v1/models
    runtime._context_length("127.0.0.1:8101", 4096)
    assert runtime.kv.context("big") == 32768
    assert runtime.kv.context("") == 4096  # the top-level pools' group


async def test_a_process_given_the_load_table_counts_the_other_rows_and_beats(
    tmp_path: Path,
) -> None:
    """As `up` starts a worker: the main process made the table (row 0); the runtime of the
    config that names row 1 reads row 0's counts at its picks and keeps its heartbeat."""
    path = tmp_path / "load.table"
    main = SharedLoad.create(path, 2, time.monotonic)
    table = {"path": str(path), "rows": 2, "row": 1}
    runtime = Runtime(parse_config(MINIMAL | {"extproc": {"load_table": table}}), "unix:/x")
    main.publish(Role.PREFILL, P, 3, 120, 0)
    state = runtime.prefill.pick()
    assert state is not None and (state.peer_in_flight, state.peer_pending_tokens) == (3, 120)
    assert runtime.shared_load is not None
    runtime.shared_load.start()
    await runtime.shared_load.stop()
    off = MINIMAL | {"extproc": {"load_table": table, "share_load": False}}
    assert Runtime(parse_config(off), "unix:/x").shared_load is None


@pytest.mark.parametrize("rows", [2, 3])
def test_a_load_table_that_cannot_be_mapped_is_one_line(tmp_path: Path, rows: int) -> None:
    """No file, or one too small for its rows: said in one line, not a traceback."""
    path = tmp_path / "load.table"
    if rows == 3:
        SharedLoad.create(path, 2, time.monotonic)
    table = {"path": str(path), "rows": rows, "row": 1}
    with pytest.raises(ConfigError, match=r"^extproc.load_table: cannot map .*leave it out"):
        Runtime(parse_config(MINIMAL | {"extproc": {"load_table": table}}), "unix:/x")
