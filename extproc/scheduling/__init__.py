"""Who serves a request: the pools, admission, the decode-only decision, the subset hint."""
