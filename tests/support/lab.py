"""What the lab's tests share: small config files as `up` takes them, and a Mooncake trace."""

from __future__ import annotations

import json
from pathlib import Path

ROUND_ROBIN = """
prefill:
  policy: round_robin
  endpoints: [127.0.0.1:8100]
decode:
  policy: round_robin
  endpoints: [127.0.0.1:8200]
decision: {mode: off}
"""

RANDOM = """
decision: {mode: off}
prefill:
  policy: random
  endpoints: [127.0.0.1:8100]
decode:
  policy: random
  endpoints: [127.0.0.1:8200]
"""

KV_CACHE = """
decision: {mode: off}
tokenizer: /models/not-here  # the lab's placeholder stands in: prompts are token ids
prefill:
  policy: kv_cache
  kv_events: {port: 5557}
  endpoints: [127.0.0.1:8100]
decode:
  policy: kv_cache
  kv_events: {port: 5557}
  endpoints: [127.0.0.1:8200]
"""


def config_file(folder: Path, name: str, text: str) -> Path:
    path = folder / f"{name}.yaml"
    path.write_text(text)
    return path


def mooncake_trace(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def shared_block_trace(count: int) -> list[dict[str, object]]:
    """`count` requests 50 ms apart, two 512-token blocks each, every third request's first
    block shared with the others of its group (hash ids 0, 1, 2)."""
    return [
        {
            "timestamp": 50 * i,
            "input_length": 1000,
            "output_length": 8,
            "hash_ids": [i % 3, 100 + i],
        }
        for i in range(count)
    ]
