"""How much of a request reaches the engine's prompt, for the decode-only decision.

vLLM renders more than `messages` into a chat prompt: `tools`, `documents`,
`chat_template_kwargs`, `tool_choice`, `response_format`, `reasoning_effort`, whatever the
model's template reads; a completion's `prompt_embeds` are prompt positions too. Rather than
list them (each vLLM version adds some), every member counts except the sampling and output
controls below, which never reach the prompt: a field unknown here errs toward disaggregation,
which costs a little time, never toward a prefill that D was not meant to run.

Some prompts cannot be bounded by the body's bytes at all: a client's own `chat_template` (a
loop renders any length), multimodal content (a short image URL can be thousands of tokens)
and `mm_processor_kwargs` (which size it). Those have no size: never decode-only.
"""

from __future__ import annotations

from typing import Any

from extproc.request.parse import Api, ClientRequest

__all__ = ["TOKENIZED", "prompt_bytes"]

# Members that never reach the prompt (sampling, output and routing controls).
_OUTSIDE_PROMPT = frozenset(
    {
        "model",
        "stream",
        "stream_options",
        "n",
        "max_tokens",
        "max_completion_tokens",
        "min_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "length_penalty",
        "logit_bias",
        "logprobs",
        "top_logprobs",
        "prompt_logprobs",
        "stop",
        "stop_token_ids",
        "ignore_eos",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "include_stop_str_in_output",
        "add_generation_prompt",
        "continue_final_message",
        "add_special_tokens",
        "echo",
        "user",
        "request_id",
        "session_id",
        "priority",
        "cache_salt",
        "return_token_ids",
        "return_tokens_as_token_ids",
        "truncate_prompt_tokens",
        "kv_transfer_params",  # dropped from every leg (the router's)
        "ec_transfer_params",
    }
)
# What the KV-cache router's tokenizer renders (`extproc.request.plan.request_tokens`): with
# its count, these members' bytes are not estimated again.
TOKENIZED = {
    Api.CHAT: frozenset({"messages", "tools", "chat_template_kwargs"}),
    Api.COMPLETIONS: frozenset({"prompt"}),
}
_UNBOUNDED_FIELDS = ("chat_template", "mm_processor_kwargs")


def prompt_bytes(request: ClientRequest, counted: frozenset[str] = frozenset()) -> int | None:
    """The JSON bytes of the members that reach the prompt, less those in `counted` (their
    tokens are known); None when the prompt's size cannot be told from the body."""
    doc = request.doc
    if any(doc.get(name) is not None for name in _UNBOUNDED_FIELDS):
        return None
    if request.api is Api.CHAT and _has_media(doc.get("messages")):
        return None
    return sum(
        len(raw) for key, raw in request.parts if key not in _OUTSIDE_PROMPT and key not in counted
    )


def _has_media(messages: Any) -> bool:
    """A message with a content part that is not text (an image, audio, video, a file)."""
    if not isinstance(messages, list):
        return False
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list) and any(
            not isinstance(part, dict) or part.get("type") != "text" for part in content
        ):
            return True
    return False
