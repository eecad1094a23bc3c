"""A pd-extproc config file, as `up` takes it, with the lab's engines as its pools' members.

Everything else in the file is the product's to read (policies and their options, admission,
the decision, dispatch, timeouts, the KV index); what the lab changes:
- each top-level pool's members: its `endpoints` become the simulated engines of that role
  (`dns`, `kubernetes` and `inference_pool` are dropped, and with them any per-endpoint
  setting such as an endpoint's own `mode` or `data_parallel_size`: the pool's
  `data_parallel_size` gives every server of the role its ranks);
- `tokenizer`: a placeholder stands in for the model's (the file need not exist here). The
  lab's prompts are token ids, which the sidecar passes on as they are, or with `--tokenize`
  text of a word per id (`lab.tokenizer`), which the placeholder's vocabulary maps back.
A config the lab cannot model yet is refused with one line saying what.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from tokenizers import Tokenizer, models, pre_tokenizers

from extproc.config import Config, ConfigError, parse_config
from lab.workloads import VOCAB

__all__ = ["lab_config", "placeholder_tokenizer"]

_MEMBER_SOURCES = ("endpoints", "dns", "kubernetes", "inference_pool")


def placeholder_tokenizer(folder: Path, words: bool = False) -> Path:
    """A tokenizer.json that loads (KV-cache routing needs one) and refuses none of the
    workloads' token ids (the sidecar refuses ids past a tokenizer's vocabulary). `words`:
    with a word per id (`t42`: id 42, `lab.workloads.prompt_text`), so that it encodes the
    lab's text prompts to their ids (0.3 s to build, 0.2 s to load: only then)."""
    if words:
        vocab = {"<unk>": 0} | {f"t{i}": i for i in range(1, VOCAB)}
    else:
        vocab = {"<unk>": 0, "<last>": VOCAB - 1}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    path = folder / "tokenizer.json"
    tokenizer.save(str(path))
    return path


def _read(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as error:
        raise ConfigError(f"cannot read config file {path}: {error.strerror}") from None
    except yaml.YAMLError as error:
        raise ConfigError(f"{path}: not valid YAML: {error}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    return data


def lab_config(path: Path, members: dict[str, list[str]], tokenizer: Path) -> Config:
    """The config in `path`, its pools' members replaced by `members` (role → addresses)."""
    data = _read(path)
    if data.get("models"):
        raise ConfigError(
            f"{path}: the lab replaces the top-level pools' members; per-model pools "
            "(`models:`) are not modelled yet: use a config without them"
        )
    for role, addresses in members.items():
        pool = data.get(role)
        pool = dict(pool) if isinstance(pool, dict) else {}
        for key in _MEMBER_SOURCES:
            pool.pop(key, None)
        pool["endpoints"] = list(addresses)
        data[role] = pool
    data["tokenizer"] = str(tokenizer)
    try:
        return parse_config(data, str(path))
    except ConfigError as error:
        raise ConfigError(f"{path}: {error}") from None
