"""A small tokenizer folder shaped as the tiny model's (a byte-level BPE with a BOS, and a
role-header chat template), for the benchmark workloads' tests: no download, no cached model."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

CORPUS = [
    "Prefill engines compute the KV cache; decode engines generate the rest.",
    "Envoy hands the request body to an external processor over gRPC.",
    "NIXL moves KV blocks between engines, pulled by decode or pushed by prefill.",
]
TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)


def tiny_tokenizer(out: Path) -> Path:
    """`out` with tokenizer.json and chat_template.jinja in it."""
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        CORPUS * 10,
        trainer=trainers.BpeTrainer(
            vocab_size=400,
            special_tokens=["<s>", "</s>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    tok.save(str(out / "tokenizer.json"))
    (out / "chat_template.jinja").write_text(TEMPLATE)
    return out
