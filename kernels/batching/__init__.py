"""Batching the rows of several requests into one forward pass: ragged passes over each
request's own KV cache (ragged.py), their bitwise proof (ragged_selftest.py), and the
shared KV pool that lets such a pass write and attend to all rows at once (kv_pool.py)."""
