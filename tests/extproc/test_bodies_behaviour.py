"""What the P and D legs' bodies tell the engines, beyond the splice itself."""

from __future__ import annotations

import orjson

from extproc.bodies import members, prefill_body, prefill_kv_params


def test_p_is_asked_to_prefill_for_a_remote_decode() -> None:
    """P keeps the KV for a decode elsewhere and does not itself fetch KV (spec §3)."""
    params = prefill_kv_params("xfer-1")
    assert params["do_remote_decode"] is True
    assert params["do_remote_prefill"] is False
    assert params["transfer_id"] == "xfer-1"  # pairs P's lease with D's request


def test_without_a_transfer_id_p_gets_none_to_pair_with() -> None:
    params = prefill_kv_params()
    assert "transfer_id" not in params
    assert params["do_remote_decode"] is True


def test_p_body_carries_the_params_given() -> None:
    raw = b'{"model":"m","prompt":"p","kv_transfer_params":{"do_remote_decode":false}}'
    body = orjson.loads(prefill_body(members(raw), False, prefill_kv_params("t")))
    assert body["kv_transfer_params"] == prefill_kv_params("t")
