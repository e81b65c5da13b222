"""The prompt cache: the in-memory prefix cache of prompt KV snapshots and its disk tier."""
