"""pd-extproc: an Envoy external processor for vLLM prefill/decode disaggregation.

The sidecar reads each OpenAI request in Envoy, picks a prefill (P) and a decode (D)
engine, and with vLLM's NixlPushConnector sends both legs at the same instant, so that D's
KV registration overlaps P's prefill. See README.md.
"""

__version__ = "0.1.0"
__all__ = ["__version__"]
