"""vLLM's prefill/decode protocol: the bodies both legs carry and the prefill's identity."""
