"""Helper scripts (cached real-vLLM environments, engine harness, demos)."""
