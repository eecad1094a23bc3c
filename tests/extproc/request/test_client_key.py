"""The client's key is checked, as vLLM checks it, only where the P leg carries the sidecar's."""

from __future__ import annotations

from pathlib import Path

import pytest

from extproc.config import Config, parse_config
from extproc.errors import ClientError
from extproc.request.client_key import check_client_key, client_key_checked_here

POOLS = {"prefill": {"endpoints": ["127.0.0.1:8100"]}, "decode": {"endpoints": ["127.0.0.1:8200"]}}
NOT_FORWARDED = {"forward_headers": ["traceparent"]}


def config(tmp_path: Path, keys: str | None, dispatch: dict[str, object]) -> Config:
    engines = {}
    if keys is not None:
        key_file = tmp_path / "keys"
        key_file.write_text(keys)
        engines = {"api_key_file": str(key_file)}
    return parse_config(POOLS | {"engines": engines, "dispatch": dispatch})


def test_checked_only_where_p_gets_the_sidecars_key(tmp_path: Path) -> None:
    assert client_key_checked_here(config(tmp_path, "sk-a\n", NOT_FORWARDED))
    assert not client_key_checked_here(config(tmp_path, "sk-a\n", {}))  # forwarded: P checks it
    no_key = config(tmp_path, None, NOT_FORWARDED)
    assert not client_key_checked_here(no_key)  # no key: none to check
    for unchecked in (config(tmp_path, "sk-a\n", {}), config(tmp_path, None, NOT_FORWARDED)):
        check_client_key({}, unchecked)


@pytest.mark.parametrize("authorization", ["Bearer sk-a", "bearer sk-b", "BEARER sk-a"])
def test_any_of_the_engines_keys_passes(tmp_path: Path, authorization: str) -> None:
    check_client_key(
        {"authorization": authorization}, config(tmp_path, "sk-a\nsk-b\n", NOT_FORWARDED)
    )


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"authorization": ""},
        {"authorization": "sk-a"},
        {"authorization": "Basic sk-a"},
        {"authorization": "Bearer sk-"},
        {"authorization": "Bearer sk-a "},
        {"authorization": "Bearer  sk-a"},
        {"authorization": "Bearer sk-c"},
        {"x-api-key": "sk-a"},
    ],
)
def test_anything_else_is_refused_with_401(tmp_path: Path, headers: dict[str, str]) -> None:
    with pytest.raises(ClientError) as refused:
        check_client_key(headers, config(tmp_path, "sk-a\nsk-b\n", NOT_FORWARDED))
    assert refused.value.status == 401
    assert refused.value.message.startswith("Unauthorized")
    assert "sk-a" not in refused.value.body.decode()
