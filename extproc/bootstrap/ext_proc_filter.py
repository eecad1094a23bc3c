"""The ext_proc HTTP filter, the streamed mode of the LLM routes, and the message timeout.

The filter's own mode (every route through it but the LLM ones): request headers sent, the
body buffered. The LLM routes override it (`STREAMED_BODY`): the body streams to the ext_proc
in full duplex while the header answer is pending, so the ext_proc answers the headers
(destination, request id, exact content-length) and the new body in one turn, with no round
trip in between. Response headers are sent (the sidecar sees D's status, one cheap round trip
that overlaps decoding); the response body is not (SSE streams through untouched). Without the
ext_proc there is no decode target, so it fails closed with 503.
"""

from __future__ import annotations

from typing import Any

from extproc.bootstrap.common import TYPED, duration
from extproc.config import Config
from extproc.request.envoy_msgs import LABELS_NAMESPACE, REPLY_DETAILS, UPSTREAM_ADDRESS

EXTPROC_CLUSTER = "pd_extproc"
_EXT_PROC = "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor"
EXT_PROC_PER_ROUTE = "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute"

# Sizing of Envoy's ext_proc message timer. It runs from sending a message to its answer, and
# Envoy sends the bodies of concurrent requests interleaved on one HTTP/2 connection: a body
# in a burst is complete at the ext_proc only when about the whole burst is, so its timer
# covers every byte in flight, not just its own (with 1 s, 11 of 12 concurrent 10 MB bodies
# failed). On a busy 2-vCPU machine Envoy, the ext_proc and the engines together took in
# bursts at 20-30 MB/s (12 x 10 MB in 4-6.5 s, 200 x 0.5 MB in 2-3.5 s). The default leaves
# 1 s for a stalled Python process plus room for 16 bodies of the maximum size in flight at
# 30 MB/s: 9.9 s for 16 MiB. A longer timer costs little: an ext_proc that is down fails at
# once (503), and one that is merely slow has done the work a 504 would throw away.
_STALL_S = 1.0
_BURST_BODIES = 16
_BURST_BYTES_PER_S = 30e6


def extproc_message_timeout_s(cfg: Config) -> float:
    """timeouts.extproc_message_s, or by default sized from limits.max_body_bytes."""
    if cfg.timeouts.extproc_message_s is not None:
        return cfg.timeouts.extproc_message_s
    burst = _BURST_BODIES * cfg.limits.max_body_bytes / _BURST_BYTES_PER_S
    return round(_STALL_S + burst, 1)


_MODE = {
    "request_header_mode": "SEND",
    "request_body_mode": "BUFFERED",
    "request_trailer_mode": "SKIP",
    "response_header_mode": "SEND",
    "response_body_mode": "NONE",
    "response_trailer_mode": "SKIP",
}
# Streamed: Envoy neither buffers nor times the request body here (the ext_proc enforces
# limits.max_body_bytes and owns the upload's timeout); Envoy requires request trailers SEND.
# Response trailers SEND keeps the ext_proc stream open until the response ends (otherwise
# Envoy closes it once the response headers are answered, and the ext_proc would count the
# request, and the engines' load, as finished while D still generates); an SSE response has
# no trailers, so no message is sent for them.
STREAMED_BODY = _MODE | {
    "request_body_mode": "FULL_DUPLEX_STREAMED",
    "request_trailer_mode": "SEND",
    "response_trailer_mode": "SEND",
}


def streamed_body_route() -> dict[str, Any]:
    """The per-route config that streams the request body of one route to the ext_proc."""
    return {TYPED: EXT_PROC_PER_ROUTE, "overrides": {"processing_mode": dict(STREAMED_BODY)}}


def ext_proc_filter(cfg: Config) -> dict[str, Any]:
    return {
        "name": "envoy.filters.http.ext_proc",
        "typed_config": {
            TYPED: _EXT_PROC,
            "grpc_service": {"envoy_grpc": {"cluster_name": EXTPROC_CLUSTER}},
            "failure_mode_allow": False,  # without the ext_proc there is no decode target
            "status_on_error": {"code": 503},
            "message_timeout": duration(extproc_message_timeout_s(cfg)),
            # serial dispatch extends the timer while P computes (override_message_timeout)
            "max_message_timeout": duration(cfg.timeouts.prefill_s + 5),
            # streamed: the content-length the header answer sets reaches D (else removed)
            "allow_content_length_header": True,
            # the request's labels, for the access log (`extproc.request.access_log`)
            "metadata_options": {"receiving_namespaces": {"untyped": [LABELS_NAMESPACE]}},
            # with the response headers: did D answer, or Envoy without reaching it; and which
            # D answered (the fallback, after a refused connection, takes the in-flight count)
            "response_attributes": [REPLY_DETAILS, UPSTREAM_ADDRESS],
            "processing_mode": dict(_MODE),
        },
    }
