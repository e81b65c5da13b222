"""Distributed serving on mlx.distributed: one deployment over several ranks (GPUs or Macs).

Every rank runs the same engine iterations on its shard of the model; rank 0 serves HTTP and
broadcasts each iteration's inputs (docs/DISTRIBUTED.md).

| module | job |
|---|---|
| `world.py` | backend detection, `mx.distributed.init` under a connect timeout, the startup identity exchange |
| `collectives.py` | byte broadcast / gather over the group; `ordered_all_sum` (rank-order, batch invariant) |
| `sharded_layers.py` | mlx-lm's sharded linears made batch invariant (canonical rows, ordered reduction) |
| `pipeline.py` | a pipeline-parallel llama, patched onto the loaded model from outside |
| `sharding.py` | checks (heads, layers) and `shard_model`: tensor via mlx-lm `shard()`, or pipeline |
| `proofs.py` | startup proofs (self-test, ragged passes) that every rank runs alike and agrees on |
| `replicated_engine.py` | `ReplicatedEngine`: the Engine whose iterations rank 0 broadcasts |
| `watchdog.py` | bounded failure: no collective for too long, or a lost peer, ends the process non-zero |
| `startup.py` | what `lockstep serve --parallel ...` adds to the one serve assembly (server/commands/serve.py): flags, startup checks, agreement on the built runtime, the health gate |
"""
