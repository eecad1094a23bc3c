"""vllmsim's KV events decode with vLLM's own msgspec types (vllm.distributed.kv_events), in
the cached vLLM venv that .ci/run builds before this stage. No engine of vLLM runs here."""

from __future__ import annotations

import json
import subprocess
from typing import Any

import aiohttp
import msgpack
import pytest

from scripts.cached_envs import CACHE_DIR
from tests.vllmsim.kv_event_helpers import LOOPBACK_ENV, events_flag, replay
from vllmsim.launcher import FAST, running_engine
from vllmsim.prefix_cache import block_hashes, external_hash

pytestmark = [pytest.mark.real_vllm, pytest.mark.timeout(300)]

VLLM_PYTHON = CACHE_DIR / "vllm-venv" / "bin" / "python"

# Runs in vLLM's venv: decode each payload (hex, one a line) as vLLM's KVEventBatch, strictly
# typed, and print what the decoder made of it; also vLLM's own block hashes of a prompt.
_DECODE = """
import json, sys
import msgspec
from vllm.distributed.kv_events import KVEventBatch
from vllm.utils.hashing import sha256
from vllm.v1.core import kv_cache_utils as k
decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
prompt = json.loads(sys.argv[1])
k.init_none_hash(sha256)
parent, hashes = None, []
for start in range(0, len(prompt) - 15, 16):
    parent = k.hash_block_tokens(sha256, parent, prompt[start:start + 16], None)
    hashes.append(k.maybe_convert_block_hash(parent))
out = []
for line in sys.stdin:
    batch = decoder.decode(bytes.fromhex(line.strip()))
    out.append({"ts": batch.ts, "rank": batch.data_parallel_rank,
                "events": [[type(e).__name__, msgspec.to_builtins(e)] for e in batch.events]})
print(json.dumps({"batches": out, "vllm_hashes": hashes}))
"""


def vllm_decode(payloads: list[bytes], prompt: list[int]) -> dict[str, Any]:
    proc = subprocess.run(
        [str(VLLM_PYTHON), "-c", _DECODE, json.dumps(prompt)],
        input="\n".join(p.hex() for p in payloads),
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.skipif(
    not VLLM_PYTHON.exists(), reason=f"no vLLM venv at {VLLM_PYTHON} (scripts/cached_envs.py vllm)"
)
async def test_vllm_decodes_the_simulators_events() -> None:
    prompt = [1, *range(2000, 2047)]  # 48 tokens: 3 full blocks
    other = [2, *range(3000, 3063)]
    async with (
        running_engine(*FAST, "--num-gpu-blocks", "6", *events_flag(), env=LOOPBACK_ENV) as eng,
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as http,
    ):
        assert eng.kv_events_replay_endpoint is not None
        for p in (prompt, other):  # the second evicts blocks of the first
            async with http.post(
                eng.url + "/v1/completions", json={"prompt": p, "max_tokens": 8}
            ) as resp:
                assert resp.status == 200
        payloads = [p for _, _, p in replay(eng.kv_events_replay_endpoint, 0)]
    decoded = vllm_decode(payloads, prompt)
    kinds = [kind for b in decoded["batches"] for kind, _ in b["events"]]
    assert "BlockStored" in kinds and "BlockRemoved" in kinds
    # vLLM's decoder reads exactly what the simulator meant
    for batch, payload in zip(decoded["batches"], payloads, strict=True):
        ours = msgpack.unpackb(payload)
        assert batch["rank"] == 0 and batch["ts"] == ours[0]
        for (kind, fields), event in zip(batch["events"], ours[1], strict=True):
            assert kind == event["type"]
            assert {k: v for k, v in fields.items() if k in event and k != "type"} == {
                k: v for k, v in event.items() if k != "type"
            }
    first = decoded["batches"][0]["events"][0][1]
    # the chain hashes are vLLM's own for this prompt
    assert first["block_hashes"] == decoded["vllm_hashes"]
    assert first["block_hashes"] == [external_hash(h) for h in block_hashes(prompt, 16)]
    assert first["token_ids"] == prompt and first["medium"] == "GPU"
