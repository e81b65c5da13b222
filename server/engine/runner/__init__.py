"""Running passes on the model: `ModelRunner` (ragged passes, the KV pool, compiled passes),
decoding ahead, and the step data that passes between the scheduler and the runner."""
