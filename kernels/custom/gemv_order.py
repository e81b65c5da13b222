"""NumPy model of the order gemv_rows.cu follows: that of MLX's single-row CUDA GEMV
(mlx/backend/cuda/gemms/gemv.cu), the call a plain decode step makes for x @ W.T.

- one warp of 32 lanes computes an output column; K is never split across warps;
- lane l takes NPT consecutive elements at k = NPT * l + 32 * NPT * i, i = 0, 1, ..; in
  units of NPT: unit u goes to lane u % 32 (loop_order.lane_schedule with unit NPT);
- NPT = 4 where K % 128 == 0, 2 where K % 64 == 0, else 1 (MLX also asks for aligned
  pointers, which its arrays' buffers are);
- acc = fma(w, x, acc) in float32 from 0, then the xor butterfly over the lanes.

Nothing depends on M or on which warp computes a column (warp_shape): a row's bits are a
function of its own x row, W and K.
"""
import numpy as np

from .loop_order import skinny_matmul

MAX_ROWS = 64
TARGET_WARPS = 4096  # about 31 warps per SM of an H200 (132 SMs) before a warp takes more columns


def lanes_per_step(k: int) -> int:
    """Elements a lane takes per step (MLX's n_per_thread)."""
    if k % 128 == 0:
        return 4
    if k % 64 == 0:
        return 2
    return 1


def warp_shape(m: int, n: int) -> tuple:
    """(output columns, rows) per warp for an M-row call on N columns. From 5 rows, 4 columns
    x 8 rows a warp (each x load serves 4 columns, each weight load 8 rows; chosen at the 8B
    layer shapes: bench/results/history/2026-12-01-h200-gemv-rows-issue9.md);
    for 2..4 rows one column a warp keeps
    enough warps in flight, but a wide N affords more. Never changes the order of an
    output's sum."""
    if m > 4:
        return 4, 8
    rows = 2 if m <= 2 else 4
    for columns in (4, 2):
        if -(-n // columns) >= TARGET_WARPS:
            return columns, rows
    return 1, rows


def lane_steps(k: int) -> list:
    """For each lane, its k indices in order, transcribed from MLX's loop
    (col = NPT * lane; col < K; col += 32 * NPT; then NPT consecutive elements)."""
    npt = lanes_per_step(k)
    return [[col + j for col in range(npt * lane, k, 32 * npt) for j in range(npt)] for lane in range(32)]


def gemv_rows(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """float32 result of x (M, K) @ w (N, K).T in MLX's single-row GEMV order, every row
    alike (x, w as float32: bf16/fp16 convert exactly). Round to the output dtype after.
    The same lanes, fma chain and butterfly as the scalar skinny kernel, with units of NPT."""
    return skinny_matmul(x, w, lanes_per_step(np.shape(x)[1]))
