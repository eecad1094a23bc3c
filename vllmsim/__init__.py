"""vllmsim: a simulated vLLM 0.33 engine for prefill/decode disaggregation tests.

One process = one engine: an aiohttp OpenAI-compatible server, a modelled step loop
and a NIXL-like TCP side channel for KV pull (READ) and push (WRITE). See
``vllmsim --help`` and docs/simulator.md.
"""

__all__ = ["__version__"]

__version__ = "0.1.0"
