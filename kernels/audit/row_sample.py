"""Which output rows a probe of a large layer compares: a fixed sample, so its reference costs
the sample's rows × K, not N × K.

A probe that runs on the whole layer (`slicing.full_size`: the backend picks its kernel by N)
would otherwise decode the whole weight in NumPy for its reference: seconds for a 128,256-row
head or embedding, more than the kernels' own first calls. The kernel still computes all N
outputs; the probe compares these rows with the reference and requires every output finite:

- `EDGE_ROWS` whole at each end. The last ones hold the whole last tile of any tiling along N
  of up to that many rows (Metal's qmv: 8 rows a threadgroup, its tiled matmuls 32 or 64;
  CUDA's sm80 path needs N % 128), so the partial last tile, the 16-row tail of a dim that is
  16 mod 32 and the last rows of a vocabulary are compared as in the full check; the first
  ones hold a whole first tile and every residue mod those tiles.
- One row of every `BLOCK_ROWS`-row block between them (the tiled kernels' smallest tile: each
  of their tiles has a compared row), at an offset that steps by `OFFSET_STEP` from block to
  block: co-prime with `BLOCK_ROWS`, so every residue mod 32 (the 16-mod-32 rows among them)
  is compared throughout the layer, not only at its ends.
- Every compared row is decoded and compared over all of K. Quantization groups run along K,
  so each group boundary and the K tail are checked in every compared row, as before.

Layers under `WHOLE_BELOW` rows are compared whole: the sample would be most of them.
"""
from __future__ import annotations

import numpy as np

EDGE_ROWS = 256
BLOCK_ROWS = 32
OFFSET_STEP = 13
WHOLE_BELOW = 4 * EDGE_ROWS


def compared_rows(n: int) -> np.ndarray | None:
    """Sorted output rows of an `n`-row layer a probe compares; None: all of them."""
    if n < WHOLE_BELOW:
        return None
    blocks = np.arange(-(-n // BLOCK_ROWS))
    middle = blocks * BLOCK_ROWS + (blocks * OFFSET_STEP) % BLOCK_ROWS
    edges = np.concatenate([np.arange(EDGE_ROWS), np.arange(n - EDGE_ROWS, n)])
    return np.union1d(edges, middle[middle < n])
