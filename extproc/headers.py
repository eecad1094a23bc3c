"""Header names that the request path, the Envoy configuration and the sidecar's config share.

They sit apart from the modules that use them so that the config schema (which refuses them as
headers to forward) and the rendered Envoy files need not import the request path.
"""

__all__ = [
    "DESTINATION_HEADER",
    "ENGINE_PRIORITY_HEADER",
    "LOCAL_REPLY_HEADER",
    "RANK_HEADER",
    "SIDECAR_HEADERS",
]

# The Gateway API Inference Extension header that the override_host LB policy reads.
DESTINATION_HEADER = "x-gateway-destination-endpoint"
# Set by Envoy on its own local replies to the P leg (the prefill listener): the response flags
# that tell a reply that never reached P from P's own answer.
LOCAL_REPLY_HEADER = "x-pd-extproc-envoy-flags"
# vLLM's header that sends a request to one data-parallel engine rank behind an API server; the
# ext_proc sets it on both legs of an endpoint with ranks, and removes a client's copy.
RANK_HEADER = "x-data-parallel-rank"
# What only the sidecar and its Envoy set on an engine's request: a client's copy never reaches
# an engine, however the request goes (the LLM paths, the engines' own endpoints passed through).
SIDECAR_HEADERS = (DESTINATION_HEADER, RANK_HEADER, LOCAL_REPLY_HEADER)
# vLLM's header that sets a request's scheduling priority (it wins over the body's `priority`):
# under --scheduling-policy priority it orders the engine's queue and picks whom it preempts.
# Removed from a client's request unless dispatch.client_engine_priority lets it pass.
ENGINE_PRIORITY_HEADER = "x-vllm-priority"
