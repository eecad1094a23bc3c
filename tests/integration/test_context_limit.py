"""A prompt that provably fits no engine is refused before it is tokenized, through the real
Envoy and ext_proc with vllmsim engines: a 400 naming the engines' context length (each
said it on /v1/models: the prefill to the probe, both to the health check), and no engine leg.

The sidecar's tokenizer is a byte-level BPE whose longest token is 4 characters, so a text of
n characters is at least n / 4 tokens; the engines run 512 tokens. vllmsim counts words, so the
refused prompt (one long word) is one the engines themselves would have served.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import orjson
import pytest
import pytest_asyncio
from tokenizers import Tokenizer, models, pre_tokenizers

from tests.support.engines import MODEL
from tests.support.topology import Topology, topology
from vllmsim.launcher import FAST

CONTEXT = 512
LONGEST = 4  # characters in the tokenizer's longest token


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("bpe-model")
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {c: i for i, c in enumerate([*alphabet, "xx", "xxxx"])}
    tokenizer = Tokenizer(models.BPE(vocab, [("x", "x"), ("xx", "xx")]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder


@pytest_asyncio.fixture(scope="module")
async def topo(model_dir: Path) -> AsyncIterator[Topology]:
    async with topology(
        engine_flags=(*FAST, "--max-model-len", str(CONTEXT)),
        prefill={"kv_events": {}},
        decode={"kv_events": {}},
        tokenizer=str(model_dir),
    ) as topo:
        yield topo


def completion(prompt: str) -> bytes:
    return orjson.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 1})


async def test_a_prompt_longer_than_every_engines_context_gets_a_400_and_reaches_no_engine(
    topo: Topology,
) -> None:
    await topo.clear()
    prompt = "x" * (CONTEXT * LONGEST + 1)  # 513 tokens at least
    status, payload, _ = await topo.post("/v1/completions", completion(prompt))
    assert status == 400, payload
    error = orjson.loads(payload)["error"]
    assert error["message"] == (
        f"This model's maximum context length is {CONTEXT} tokens. However, the prompt is "
        f"at least {CONTEXT + 1} tokens; shorten the prompt"
    ), error
    for engine in topo.engines:
        assert await topo.seen(engine) == []


async def test_a_prompt_that_may_fit_goes_through(topo: Topology) -> None:
    await topo.clear()
    prompt = "x" * (CONTEXT * LONGEST)  # 128 tokens: it fits
    status, payload, _ = await topo.post("/v1/completions", completion(prompt))
    assert status == 200, payload
    assert all([await topo.seen(engine) for engine in topo.engines])
