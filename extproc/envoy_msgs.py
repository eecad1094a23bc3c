"""Pure builders of the ext_proc ProcessingResponse messages the sidecar sends to Envoy."""

from __future__ import annotations

import functools
from collections.abc import Iterable

from envoy.config.core.v3 import base_pb2 as core
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.type.v3 import http_status_pb2
from google.protobuf.duration_pb2 import Duration
from google.protobuf.struct_pb2 import Struct

from extproc.errors import RequestEnded

__all__ = [
    "DESTINATION_HEADER",
    "LABELS_NAMESPACE",
    "Labels",
    "body_answer",
    "continue_request_headers",
    "continue_response_headers",
    "extend_timeout",
    "header_map",
    "immediate",
    "request_labels",
]

# The Gateway API Inference Extension header that the override_host LB policy reads.
DESTINATION_HEADER = "x-gateway-destination-endpoint"
_OVERWRITE = core.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
# The dynamic-metadata namespace of the request's labels, which Envoy's access log carries back
# to the ext_proc (`extproc.access_log`); the ext_proc filter is allowed to write only this one.
LABELS_NAMESPACE = "pd_extproc"


def _header(key: str, value: str) -> core.HeaderValueOption:
    return core.HeaderValueOption(
        header=core.HeaderValue(key=key, raw_value=value.encode()), append_action=_OVERWRITE
    )


def header_map(headers: ep.HttpHeaders) -> dict[str, str]:
    """Envoy's header list as a dict (lowercase keys; raw_value wins over value)."""
    return {
        h.key: h.raw_value.decode(errors="replace") if h.raw_value else h.value
        for h in headers.headers.headers
    }


_CONTINUE_REQUEST = ep.ProcessingResponse(request_headers=ep.HeadersResponse())
_CONTINUE_RESPONSE = ep.ProcessingResponse(response_headers=ep.HeadersResponse())


def continue_request_headers() -> ep.ProcessingResponse:
    return _CONTINUE_REQUEST


# A request's labels for Envoy's access log: (strategy, model). Few: the model is bounded.
Labels = tuple[str, str]


def continue_response_headers(labels: Labels | None = None) -> ep.ProcessingResponse:
    if labels is None:
        return _CONTINUE_RESPONSE
    return _continue_labelled(labels)


@functools.lru_cache(maxsize=1024)  # built once per label pair, then shared (never modified)
def _continue_labelled(labels: Labels) -> ep.ProcessingResponse:
    return ep.ProcessingResponse(
        response_headers=ep.HeadersResponse(), dynamic_metadata=request_labels(labels)
    )


@functools.lru_cache(maxsize=1024)
def request_labels(labels: Labels) -> Struct:
    """The request's labels as the stream's dynamic metadata: Envoy puts them in the request's
    access-log entry, so whichever ext_proc process receives the entry labels it right."""
    strategy, model = labels
    metadata = Struct()
    metadata.update({LABELS_NAMESPACE: {"strategy": strategy, "model": model}})
    return metadata


def body_answer(body: bytes, destinations: Iterable[str], request_id: str) -> ep.ProcessingResponse:
    """Replace the body, route to `destinations` (ordered fallbacks), set the request id.

    With request headers SENT and the body BUFFERED, Envoy checks content-length against the
    new body, so it is set here (a stale value fails the request).
    """
    mutation = ep.HeaderMutation(
        set_headers=[
            _header(DESTINATION_HEADER, ",".join(destinations)),
            _header("x-request-id", request_id),
            _header("content-length", str(len(body))),
        ]
    )
    return ep.ProcessingResponse(
        request_body=ep.BodyResponse(
            response=ep.CommonResponse(
                header_mutation=mutation, body_mutation=ep.BodyMutation(body=body)
            )
        )
    )


def extend_timeout(seconds: float) -> ep.ProcessingResponse:
    """Ask Envoy to wait longer for our next answer (serial dispatch waits for P)."""
    whole = int(seconds)
    return ep.ProcessingResponse(
        override_message_timeout=Duration(seconds=whole, nanos=int((seconds - whole) * 1e9))
    )


def immediate(error: RequestEnded, labels: Labels | None = None) -> ep.ProcessingResponse:
    """End the client request with an OpenAI-style JSON error.

    Before the response started the client gets it as is; after, Envoy can no longer change
    the status it sent, so it resets the client and the decode upstream instead.
    """
    headers = [_header("content-type", "application/json")]
    if error.retry_after_s is not None:
        headers.append(_header("retry-after", str(error.retry_after_s)))
    return ep.ProcessingResponse(
        immediate_response=ep.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=error.status),
            headers=ep.HeaderMutation(set_headers=headers),
            body=error.body,
            details=f"pd_extproc_{error.status}",
        ),
        dynamic_metadata=None if labels is None else request_labels(labels),
    )
