"""vLLM's side of the KV-index contract tests; runs in the vllm venv, not the project's.

python kv_vllm_side.py encode            print vLLM-encoded KVEventBatch payloads (JSON)
python kv_vllm_side.py publish           serve those batches from vLLM's ZmqEventPublisher;
                                         on ports of the OS's choice (printed, JSON);
                                         each stdin line publishes one more; EOF ends it
python kv_vllm_side.py tokens MODEL      print vLLM's token ids for the cases on stdin (JSON)
"""

from __future__ import annotations

import base64
import json
import sys

BLOCK = 4
# 32-byte hashes, as vLLM's default sha256 writes them, and int ones, as with
# VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES: the decoder must give both the same 64-bit int.
H1, H2, H3 = b"\x11" * 32, b"\x22" * 32, b"\x33" * 32
INT_H4 = int.from_bytes(b"\x44" * 32, "big") & ((1 << 64) - 1)


def batches() -> list[object]:
    from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch

    def stored(hashes: list[object], parent: object, tokens: list[int], **extra: object) -> object:
        return BlockStored(
            block_hashes=hashes,
            parent_block_hash=parent,
            token_ids=tokens,
            block_size=BLOCK,
            lora_id=None,
            medium="GPU",
            lora_name=None,
            **extra,
        )

    return [
        KVEventBatch(ts=1000.0, events=[stored([H1, H2], None, list(range(1, 9)))]),
        KVEventBatch(
            ts=1001.0,
            events=[
                stored(
                    [H3], H2, list(range(9, 13)), group_idx=0, kv_cache_spec_kind="full_attention"
                )
            ],
            data_parallel_rank=0,
        ),
        KVEventBatch(ts=1002.0, events=[stored([INT_H4], H3, list(range(13, 17)))]),
        KVEventBatch(ts=1003.0, events=[BlockRemoved(block_hashes=[INT_H4], medium="GPU")]),
    ]


def encode() -> None:
    import msgspec
    from vllm.distributed.kv_events import AllBlocksCleared, KVEventBatch

    encoder = msgspec.msgpack.Encoder()  # what ZmqEventPublisher encodes with
    payloads = [encoder.encode(b) for b in batches()]
    payloads.append(encoder.encode(KVEventBatch(ts=1004.0, events=[AllBlocksCleared()])))
    print(json.dumps([base64.b64encode(p).decode() for p in payloads]))


def publish(endpoint: str = "tcp://127.0.0.1:*", replay: str = "tcp://127.0.0.1:*") -> None:
    import zmq
    from vllm.distributed.kv_events import BlockStored, KVEventBatch, ZmqEventPublisher

    publisher = ZmqEventPublisher(0, endpoint=endpoint, replay_endpoint=replay)
    for batch in batches():
        publisher.publish(batch)
    publisher._event_queue.join()  # all sent, and in the replay buffer
    bound = [s.getsockopt(zmq.LAST_ENDPOINT).decode() for s in (publisher._pub, publisher._replay)]
    print(json.dumps(bound), flush=True)
    for n, _ in enumerate(sys.stdin):  # more batches, until the subscriber has one
        publisher.publish(
            KVEventBatch(
                ts=2000.0 + n,
                events=[
                    BlockStored(
                        block_hashes=[n + 1000],
                        parent_block_hash=None,
                        token_ids=[7] * BLOCK,
                        block_size=BLOCK,
                        lora_id=None,
                        medium="GPU",
                        lora_name=None,
                    )
                ],
            )
        )
    publisher.shutdown()


def tokens(model: str) -> None:
    from vllm.config import ModelConfig, VllmConfig
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.renderers.registry import renderer_from_config

    model_config = ModelConfig(model=model, tokenizer=model)
    renderer = renderer_from_config(VllmConfig(model_config=model_config))
    out = []
    for case in json.load(sys.stdin):
        if "prompt" in case:
            (engine_prompt,) = renderer.render_cmpl([{"prompt": case["prompt"]}])
        else:  # as vLLM's OpenAI server builds a chat request's parameters
            request = ChatCompletionRequest(model="tiny", messages=case["messages"])
            _, (engine_prompt,) = renderer.render_chat(
                [request.messages],
                request.build_chat_params(None, "auto"),
                request.build_tok_params(model_config),
            )
        out.append(engine_prompt["prompt_token_ids"])
    print(json.dumps(out))


if __name__ == "__main__":
    command, *args = sys.argv[1:]
    {"encode": encode, "publish": publish, "tokens": tokens}[command](*args)
