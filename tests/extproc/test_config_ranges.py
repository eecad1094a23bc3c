"""Every duration in the config has a range, and `off` means off as YAML reads it."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from pydantic import BaseModel

from extproc.bootstrap.common import duration
from extproc.config import Config, ConfigError, DecisionMode, parse_config

MINIMAL: dict[str, Any] = {
    "prefill": {"endpoints": ["127.0.0.1:8100"]},
    "decode": {"endpoints": ["127.0.0.1:8200"]},
}


def _duration_fields() -> list[tuple[str, str]]:
    """(section, key) of every `*_s` setting of the config's sections, found by reading the
    models, so a duration added later is covered too."""
    found = []
    for section, field in Config.model_fields.items():
        model = field.annotation
        if isinstance(model, type) and issubclass(model, BaseModel):
            found += [(section, key) for key in model.model_fields if key.endswith("_s")]
    return found


def test_the_walk_finds_the_durations() -> None:
    fields = _duration_fields()
    assert ("health", "interval_s") in fields and ("timeouts", "kv_wait_s") in fields
    assert len(fields) >= 20


@pytest.mark.parametrize(("section", "key"), _duration_fields())
@pytest.mark.parametrize("value", [1e-9, 0, -1, 1e9, float("nan")])
def test_every_duration_out_of_range_is_one_line(section: str, key: str, value: float) -> None:
    with pytest.raises(ConfigError) as error:
        parse_config(MINIMAL | {section: {key: value}})
    lines = str(error.value).splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{section}.{key}: "), lines


@pytest.mark.parametrize(("section", "key"), _duration_fields())
def test_every_duration_default_is_in_range(section: str, key: str) -> None:
    default = getattr(getattr(parse_config(MINIMAL), section), key)
    if default is not None:  # an unset extproc_message_s is derived from the body limit
        parse_config(MINIMAL | {section: {key: default}})


def test_the_message_says_the_range() -> None:
    with pytest.raises(
        ConfigError,
        match=r"^health\.interval_s: must be between 0\.1 and 3600 "
        r"seconds \(got 1e-09\)$",
    ):
        parse_config(MINIMAL | {"health": {"interval_s": 1e-9}})


def test_a_policy_load_interval_has_a_range_too() -> None:
    pool = {"endpoints": ["127.0.0.1:8100"], "policy": "power_of_two", "load_interval_s": 1e-9}
    with pytest.raises(ConfigError, match=r"load_interval_s: must be between 0\.1 and 3600"):
        parse_config(MINIMAL | {"prefill": pool})


def test_a_body_limit_envoy_cannot_buffer_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"limits\.max_body_bytes"):
        parse_config(MINIMAL | {"limits": {"max_body_bytes": 10**10}})


def test_off_written_bare_in_yaml_is_off() -> None:
    """YAML 1.1 reads `off` as false; the docs write `mode: off` and `log_level: off`."""
    text = "decision: {mode: off}\nenvoy: {log_level: off}\n"
    cfg = parse_config(MINIMAL | yaml.safe_load(text))
    assert cfg.decision.mode is DecisionMode.OFF and cfg.envoy.log_level == "off"
    with pytest.raises(ConfigError, match=r"decision\.mode"):
        parse_config(MINIMAL | yaml.safe_load("decision: {mode: on}"))


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (30, "30s"),
        (0.1, "0.1s"),
        (9.9, "9.9s"),
        (0, "0s"),
        (1e9, "1000000000s"),
        (1e-5, "0.00001s"),
        (604800, "604800s"),
    ],
)
def test_envoy_durations_never_have_an_exponent(seconds: float, text: str) -> None:
    assert duration(seconds) == text


@pytest.mark.parametrize(
    ("extra", "where"),
    [
        ({"limits": {"max_body_bytes": True}}, "limits.max_body_bytes: a number, not true"),
        ({"health": {"interval_s": False}}, "health.interval_s: a number, not false"),
        ({"extproc": {"workers": True}}, "extproc.workers: a number, not true"),
        ({"health": {"unhealthy_after": 10**100}}, "health.unhealthy_after: "),
        ({"dispatch": {"flap_threshold": 10**100}}, "dispatch.flap_threshold: "),
        ({"decision": {"max_prompt_tokens": 10**100}}, "decision.max_prompt_tokens: "),
        ({"envoy": {"concurrency": 100_000}}, "envoy.concurrency: "),
        ({"discovery": {"kubernetes_api": "not a url"}}, "discovery.kubernetes_api: an http"),
        ({"discovery": {"kubernetes_api": "ftp://api"}}, "discovery.kubernetes_api: an http"),
        ({"discovery": {"kubernetes_api": "https://"}}, "discovery.kubernetes_api: an http"),
        ({"models": {"": MINIMAL}}, "models: '': a model name"),
        ({"models": {" m": MINIMAL}}, "models: ' m': a model name"),
    ],
)
def test_a_hostile_value_is_refused_in_one_line(extra: dict[str, Any], where: str) -> None:
    with pytest.raises(ConfigError) as error:
        parse_config(MINIMAL | extra)
    lines = str(error.value).splitlines()
    assert len(lines) == 1 and lines[0].startswith(where), lines


def test_a_bool_is_still_a_bool_and_off_still_off() -> None:
    cfg = parse_config(
        MINIMAL
        | {"metrics": {"ready_detail": True}, "envoy": {"log_level": False, "concurrency": 1024}}
        | {"discovery": {"kubernetes_api": "http://127.0.0.1:8001"}}
    )
    assert cfg.metrics.ready_detail is True and cfg.envoy.log_level == "off"
