"""One request's decoding, no scheduling: its state and prompt chunks, token sources (plain,
speculative), drafters and their costs, logits processors, sampling and stop strings."""
