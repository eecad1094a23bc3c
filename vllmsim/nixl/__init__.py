"""Simulated NIXL connectors: kv_transfer_params, side channel, pull (READ), push (WRITE)."""
