"""Local-reply configuration: how Envoy words the replies it makes itself."""

from __future__ import annotations

from typing import Any

from extproc.bootstrap.common import TYPED
from extproc.config import Config
from extproc.errors import error_body
from extproc.headers import LOCAL_REPLY_HEADER

_CEL_FILTER = "type.googleapis.com/envoy.extensions.access_loggers.filters.cel.v3.ExpressionFilter"

# Envoy refuses a path it cannot normalise (normalize_path) or one with an escaped slash
# (path_with_escaped_slashes_action) with this single detail.
_BAD_PATH = (
    "the request target is not a plain path: it has an encoded slash or backslash (%2F, %5C), "
    "a '#fragment' (which HTTP clients must not send) or an escape that does not resolve; "
    "send e.g. POST /v1/completions"
)


def _cel(expression: str) -> dict[str, Any]:
    return {
        "extension_filter": {
            "name": "envoy.access_loggers.extension_filters.cel",
            "typed_config": {TYPED: _CEL_FILTER, "expression": expression},
        }
    }


def _json_reply(status: int, message: str, when: str | None = None) -> dict[str, Any]:
    """A local-reply mapper that gives Envoy's own `status` replies (those for which the CEL
    `when` holds) an OpenAI-style JSON body. It matches that one status, so the HTTP status and
    the body's `code` always agree."""
    expression = f"response.code == {status}" + (f" && ({when})" if when else "")
    return {
        "filter": _cel(expression),
        "body": {"inline_string": error_body(status, message).decode()},
        "headers_to_add": [
            {
                "header": {"key": "content-type", "value": "application/json"},
                "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
            }
        ],
    }


def ingress_local_replies(cfg: Config) -> dict[str, Any]:
    """OpenAI-style JSON bodies for every error the ingress Envoy answers itself."""
    limit = cfg.limits.max_body_bytes
    # The ext_proc's own ImmediateResponses (its 413 too) carry their JSON already (details
    # pd_extproc_*).
    envoys_own = "!response.code_details.startsWith('pd_extproc')"
    # No answer from the ext_proc (details ext_proc_error_*): a stream that cannot open or
    # breaks gets `status_on_error` (503); a message left unanswered for the message timeout
    # gets 504 (status_on_error does not apply to it).
    extproc_failed = "response.code_details.startsWith('ext_proc_error')"
    # Every other error Envoy makes itself (upstream connect failure or reset, the KV-wait
    # idle timeout): its own text, wrapped in the OpenAI error shape; the code is the status.
    # A route's own direct_response (a user's Envoy, with the snippet) is left as it is.
    not_a_route_reply = "response.code_details != 'direct_response'"
    wrapped = {
        "json_format": {
            "error": {
                "message": "%LOCAL_REPLY_BODY%",
                "type": "UpstreamError",
                "param": None,
                "code": "%RESPONSE_CODE%",
            }
        },
        "content_type": "application/json",
    }
    return {
        "mappers": [
            _json_reply(413, f"request body exceeds the limit of {limit} bytes", envoys_own),
            _json_reply(400, _BAD_PATH, "response.code_details == 'path_normalization_failed'"),
            _json_reply(
                504,
                "the pd-extproc ext_proc did not answer within its message timeout "
                "(timeouts.extproc_message_s); retry",
                extproc_failed,
            ),
            _json_reply(503, "the pd-extproc ext_proc is unavailable; retry", extproc_failed),
            {
                "filter": _cel(f"response.code >= 400 && {envoys_own} && {not_a_route_reply}"),
                "body_format_override": wrapped,
            },
        ]
    }


# On the prefill listener: Envoy's own replies (connect failure, reset) carry their response
# flags, so the ext_proc can tell "P unreachable" from "P answered 503".
FLAG_LOCAL_REPLIES = {
    "mappers": [
        {
            "filter": {"not_health_check_filter": {}},
            "headers_to_add": [
                {"header": {"key": LOCAL_REPLY_HEADER, "value": "%RESPONSE_FLAGS%"}}
            ],
        }
    ]
}
