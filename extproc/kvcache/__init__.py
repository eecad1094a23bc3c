"""What each engine's KV cache holds, from vLLM's KV events, looked up by a request's tokens."""
