"""A config file as `up` takes it, its pools' members replaced by the lab's engines."""

from __future__ import annotations

from pathlib import Path

import pytest

from extproc.config import ConfigError
from extproc.roles import Role
from lab.configs import lab_config, placeholder_tokenizer
from tests.support.lab import KV_CACHE, config_file

MEMBERS = {"prefill": ["192.0.2.1:8000"], "decode": ["198.51.100.1:8000", "198.51.100.2:8000"]}


def test_the_pools_get_the_labs_engines_and_keep_their_settings(tmp_path: Path) -> None:
    path = config_file(
        tmp_path, "kv", KV_CACHE + "decode_dns: ignored\n".replace("decode_dns: ignored\n", "")
    )
    config = lab_config(path, MEMBERS, placeholder_tokenizer(tmp_path))
    assert config.static_addresses(Role.PREFILL) == MEMBERS["prefill"]
    assert config.static_addresses(Role.DECODE) == MEMBERS["decode"]
    assert (config.prefill.policy, config.decode.policy) == ("kv_cache", "kv_cache")
    assert config.prefill.kv_events is not None
    assert config.tokenizer == str(tmp_path / "tokenizer.json")


def test_what_the_lab_cannot_model_is_refused_in_one_line(tmp_path: Path) -> None:
    models = KV_CACHE + (
        "models:\n  other:\n"
        "    prefill: {endpoints: [10.0.0.1:1]}\n    decode: {endpoints: [10.0.0.2:1]}\n"
    )
    with pytest.raises(ConfigError, match="per-model pools"):
        lab_config(config_file(tmp_path, "m", models), MEMBERS, placeholder_tokenizer(tmp_path))
    wrong = "prefill: {policy: nope}\ndecode: {}\n"
    with pytest.raises(ConfigError, match=r"w\.yaml: prefill\.policy: unknown policy 'nope'"):
        lab_config(config_file(tmp_path, "w", wrong), MEMBERS, placeholder_tokenizer(tmp_path))
