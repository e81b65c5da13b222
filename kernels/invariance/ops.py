"""Canonical forms of the per-row ops of a transformer forward pass.

A GPU backend picks its kernel (GEMV or GEMM, split-K, SDPA split count) from the shape of
the call, so a row's result can depend on how many rows share the call. Each function here
computes every row the way a single row (M = 1, plain decode) would be computed, whatever M
is: that is the whole batch-invariance mechanism. Which canonical form is bit-identical to
M = 1 *and* cheapest differs per backend, so the form is a parameter (`Strategy`), chosen
at load time by proof (kernels/invariance/selftest.py), never assumed.

Every op is looked up on `mx` at call time (`@`, `mx.quantized_matmul`, the model's SDPA),
so the shape-variant test double (tests/doubles/shape_variant.py) sees these calls too.
"""
import math
from dataclasses import dataclass

import mlx.core as mx

from .. import custom
from ..custom.packed_kv import KV_CACHE_STEP, packed_kv  # noqa: F401 (the per-query form's keys)
# MLX's CUDA quantized matmul runs its per-row GEMV for calls of at most this many rows: each
# row gets the single-row call's bits (docs/DETERMINISM.md, qmv_rows)
from ..custom.qmv_order import MLX_GEMV_ROWS

DENSE_FORMS = ("native", "rowwise", "strided_gemv", "gemv_rows", "skinny", "mma_rows", "cpu_kernel")
QUANTIZED_FORMS = ("chunks", "skinny", "qmv_rows")
ATTENTION_FORMS = ("native", "per_query", "per_query_contiguous", "composed")


@dataclass(frozen=True)
class Strategy:
    """How rows are computed when a call has M <= L rows.

    dense: "rowwise" (one call per row), "strided_gemv" (one batched call over an (M, 1, K)
        view that cannot be folded into a GEMM, so each row gets the single-row kernel), or
        "native" (the call as the model makes it), "gemv_rows" (M = 1 the plain call; 2..64
        rows one launch of kernels/custom/gemv_rows.cu, which computes each row in the order
        of MLX's single-row CUDA GEMV and reads the weights once per 8 rows), "mma_rows"
        (per layer, kernels/custom/mma_rows.py: a large 16-bit layer's rows through skinny's
        tensor-core kernel at every width, one row included; other layers "gemv_rows").
    quantized_rows: most rows per `mx.quantized_matmul` call (1 = one row per call; CUDA
        keeps its per-row kernel up to 7 rows); 0 = native, one call for all rows.
    attention: "per_query" (each query attends exactly its key range, unmasked, one call
        each: the call decode makes), "per_query_contiguous" (the same, and every call, decode
        included, gets row-contiguous q/k/v: MLX's CUDA SDPA gives other bits for a strided
        view of the KV cache than for a packed copy: docs/DETERMINISM.md, skinny kernels),
        "composed" (all rows in a few matmuls that the CPU shim's invariant kernel takes:
        kernels/invariance/composed_attention.py; per query where it cannot serve) or "native".
    quantized_form: "chunks" (quantized_rows per call), "skinny" (kernels/custom: one
        launch for all M <= 64 rows, M = 1 included, in a reduction order fixed by K; modes
        the kernel lacks keep the chunks) or "qmv_rows" (up to MLX_GEMV_ROWS rows MLX's own
        call, its per-row GEMV, which costs the host less than a custom launch; 8..64 rows one
        launch of kernels/custom/qmv_rows.cu, each row in the order of MLX's single-row CUDA
        quantized GEMV; cases it has not proven keep the chunks). dense "skinny" is the same kernel for dense
        weights (dtypes it lacks keep strided_gemv). dense "cpu_kernel" is the plain call:
        while it is installed the CPU BLAS shim runs float32 matmuls of M <= L rows, M = 1
        included, through its own kernel, in a reduction order fixed by K
        (kernels/cpu_blas/invariant_gemm.c).
    """

    name: str
    dense: str
    quantized_rows: int
    attention: str
    quantized_form: str = "chunks"

    def __post_init__(self):
        if self.dense not in DENSE_FORMS:
            raise ValueError(f"dense form {self.dense!r} is not one of {DENSE_FORMS}")
        if self.attention not in ATTENTION_FORMS:
            raise ValueError(f"attention form {self.attention!r} is not one of {ATTENTION_FORMS}")
        if self.quantized_rows < 0:
            raise ValueError("quantized_rows must be >= 0 (0 = native)")
        if self.quantized_form not in QUANTIZED_FORMS:
            raise ValueError(f"quantized form {self.quantized_form!r} is not one of {QUANTIZED_FORMS}")

    @property
    def uses_custom_kernels(self) -> bool:
        return self.dense in ("skinny", "gemv_rows", "mma_rows") or self.quantized_form in ("skinny", "qmv_rows")

    def unavailable_reason(self, call_rows: int) -> str | None:
        """Why this strategy cannot run here for L = call_rows (None: it can)."""
        if self.dense == "cpu_kernel":
            from .. import cpu_blas

            if mx.default_device() != mx.cpu:
                return f"the invariant CPU kernel serves the CPU only, not {mx.default_device()}"
            return cpu_blas.kernel_unavailable_reason()
        if not self.uses_custom_kernels:
            return None
        if call_rows > custom.MAX_ROWS:
            return f"custom kernels take at most {custom.MAX_ROWS} rows, L = {call_rows}"
        if self.dense in ("gemv_rows", "mma_rows"):
            # its quantized layers keep the chunks where qmv_rows is not proven
            reason = custom.gemv_rows.unavailable_reason()
            if reason is None and self.dense == "mma_rows":
                reason = custom.unavailable_reason()  # its large 16-bit layers' tensor-core kernel
            return reason
        return custom.unavailable_reason()

    @property
    def is_native(self) -> bool:
        return self.dense == "native" and self.quantized_rows == 0 and self.attention == "native"


NATIVE = Strategy("native", dense="native", quantized_rows=0, attention="native")
STRIDED_GEMV = Strategy("strided_gemv", dense="strided_gemv", quantized_rows=MLX_GEMV_ROWS,
                        attention="per_query_contiguous")
ROWWISE = Strategy("rowwise", dense="rowwise", quantized_rows=1, attention="per_query_contiguous")
# Decode keeps MLX's own single-row GEMV, dense or quantized; blocks run kernels that follow
# their orders (CUDA).
GEMV_ROWS = Strategy("gemv_rows", dense="gemv_rows", quantized_rows=MLX_GEMV_ROWS, attention="per_query_contiguous",
                     quantized_form="qmv_rows")
SKINNY = Strategy("skinny", dense="skinny", quantized_rows=MLX_GEMV_ROWS, attention="per_query_contiguous",
                  quantized_form="skinny")
# gemv_rows' forms but for large 16-bit dense layers, whose rows (one included) run on tensor
# cores (CUDA): its quantized layers keep gemv_rows' bits.
MMA_ROWS = Strategy("mma_rows", dense="mma_rows", quantized_rows=MLX_GEMV_ROWS, attention="per_query_contiguous",
                    quantized_form="qmv_rows")
# Attention as matmuls the shim's kernel takes (one set of calls for all rows, decode
# included): per query, a CPU step pays op overhead for every row (composed_attention.py).
CPU_KERNEL = Strategy("cpu_kernel", dense="cpu_kernel", quantized_rows=MLX_GEMV_ROWS, attention="composed")
STRATEGIES = {s.name: s for s in (NATIVE, STRIDED_GEMV, ROWWISE, GEMV_ROWS, SKINNY, MMA_ROWS, CPU_KERNEL)}


def rows_of(x: mx.array) -> int:
    """Number of rows a linear layer sees in x (all leading dimensions together)."""
    k = x.shape[-1]
    return x.size // k if k else math.prod(x.shape[:-1])


# Dense forms whose kernel computes each row in an order of its own (gemv_rows: MLX's
# single-row GEMV; skinny: fixed by K; mma_rows: one of the two per layer), whatever the call's
# row count: a call of more than L rows may run as one launch (up to the kernel's 64 rows) with
# each row's bits those of L-row calls. The ragged proof covers every pass width the engine
# builds, these launches included.
ROW_INDEPENDENT_DENSE = ("gemv_rows", "skinny", "mma_rows")


def layer_form(form: str, x: mx.array, weight: mx.array) -> str:
    """The dense form a layer's rows run: mma_rows' choice for this layer, else `form`."""
    if form != "mma_rows":
        return form
    return custom.mma_rows.form_for(weight.shape[0], weight.shape[-1], x.dtype, weight.dtype)


def dense_rows_in_one_launch(x: mx.array, weight: mx.array, form: str):
    """dense_rows(x, weight, form) as one kernel launch for all of x's rows, where the form's
    kernel takes them (its rows do not depend on the call's width); None otherwise. x as it
    is, the output in its shape: no reshape nodes where the launch is precompiled."""
    form = layer_form(form, x, weight)
    if form not in ("gemv_rows", "skinny") or weight.ndim != 2:
        return None
    n, weight_k = weight.shape
    if weight_k != x.shape[-1] or weight.dtype != x.dtype:
        return None
    if form == "gemv_rows":
        launch = custom.gemv_rows.one_launch(x.shape[:-1], n, weight_k, x.dtype)
    else:
        launch = custom.dense_one_launch(x.shape[:-1], n, weight_k, x.dtype)
    return None if launch is None else launch(x, weight)[0]


def dense_rows(x: mx.array, weight: mx.array, form: str) -> mx.array:
    """x @ weight.T (weight is (N, K), as nn.Linear stores it), each row in canonical `form`."""
    *lead, k = x.shape
    form = layer_form(form, x, weight)
    # skinny's kernel serves M = 1 too (decode and blocks share its order); gemv_rows' rows are in
    # the order of the single-row call below (decode keeps that plain call). What the kernel
    # cannot take (not proven here, dtype, > 64 rows, no GPU kernel API) runs the strided GEMV.
    if form == "skinny" or (form == "gemv_rows" and math.prod(lead) > 1):
        out = dense_rows_in_one_launch(x, weight, form)
        if out is not None:
            return out
    if form in ("skinny", "gemv_rows"):
        form = "strided_gemv"
    rows = x.reshape(-1, k)  # built only where a form below uses it (a kernel launch does not)
    wt = weight.T
    if form in ("native", "cpu_kernel") or rows.shape[0] == 1:
        # One row is the reference every form must match (the self-test proves it): run it
        # as the plain single-row call, with no extra ops on the decode path.
        out = rows @ wt
    elif form == "rowwise":
        out = mx.concatenate([rows[i : i + 1] @ wt for i in range(rows.shape[0])], axis=0)
    elif form == "strided_gemv":
        # Rows 2K apart in an (M, 1, K) view against a 3-D weight: MLX cannot fold the batch
        # into one (M, K) GEMM, so each row runs the single-row (GEMV) kernel, batched.
        view = mx.stack([rows, mx.zeros_like(rows)], axis=1)[:, :1]
        out = (view @ wt[None])[:, 0]
    else:
        raise ValueError(f"dense form {form!r} is not one of {DENSE_FORMS}")
    return out.reshape(*lead, out.shape[-1])


def quantized_rows(
    x: mx.array,
    weight: mx.array,
    scales: mx.array,
    biases,
    *,
    group_size: int,
    bits: int,
    mode: str,
    rows_per_call: int,
    form: str = "chunks",
) -> mx.array:
    """mx.quantized_matmul(x, W.T) (any mode) with at most `rows_per_call` rows per call, or
    (forms "skinny", "qmv_rows") a custom kernel where it takes this case, for all rows in
    one launch (qmv_rows: from 8 rows; fewer are MLX's own call, its per-row GEMV)."""
    *lead, k = x.shape
    m = math.prod(lead)
    if form == "skinny" or (form == "qmv_rows" and m > MLX_GEMV_ROWS):
        out = quantized_rows_in_one_launch(x, weight, scales, biases, group_size=group_size, bits=bits, mode=mode,
                                           form=form)
        if out is not None:
            return out
    rows = x.reshape(-1, k)

    def call(r):
        return mx.quantized_matmul(
            r, weight, scales=scales, biases=biases, transpose=True,
            group_size=group_size, bits=bits, mode=mode,
        )

    if rows_per_call <= 0 or m <= rows_per_call:
        if math.prod(lead[:-1]) == 1:  # (M, K) or (1, M, K): MLX sees one matrix of rows as it is
            return call(x)
        out = call(rows)
    else:
        out = mx.concatenate(
            [call(rows[i : i + rows_per_call]) for i in range(0, m, rows_per_call)], axis=0
        )
    return out.reshape(*lead, out.shape[-1])


# Quantized forms whose kernel computes each row in an order of its own (qmv_rows: MLX's
# single-row quantized GEMV; skinny: fixed by K), whatever the call's row count.
ROW_INDEPENDENT_QUANTIZED = ("skinny", "qmv_rows")


def _quantized_kernel(rows, weight, scales, biases, group_size: int, bits: int, mode: str):
    """skinny's kernel for (M, K) rows, where it takes them; else None."""
    if custom.available() and custom.quantized_serves(rows, scales, group_size=group_size, bits=bits, mode=mode):
        return custom.quantized_matmul(rows, weight, scales, biases, group_size=group_size, bits=bits, mode=mode)
    return None


def quantized_rows_in_one_launch(x: mx.array, weight: mx.array, scales: mx.array, biases, *, group_size: int,
                                 bits: int, mode: str, form: str):
    """quantized_rows(...) as one kernel launch for all of x's rows, where the form's kernel
    takes them (its rows do not depend on the call's width); None otherwise. qmv_rows: a call
    of at most MLX_GEMV_ROWS rows is MLX's own (one call, each row its GEMV)."""
    if form == "qmv_rows":
        if weight.ndim != 2:
            return None
        if rows_of(x) <= MLX_GEMV_ROWS:
            return quantized_rows(x, weight, scales, biases, group_size=group_size, bits=bits, mode=mode,
                                  rows_per_call=MLX_GEMV_ROWS, form=form)
        n, packed = weight.shape
        launch = custom.qmv_rows.one_launch(x.shape[:-1], n, x.shape[-1], mode, bits, group_size, x.dtype,
                                            weight.dtype, packed, scales.dtype, None if biases is None else biases.dtype)
        # x as it is, the output in its shape: no reshape nodes where the launch is precompiled
        return None if launch is None else custom.qmv_rows.run(launch, mode, x, weight, scales, biases)
    if form not in ROW_INDEPENDENT_QUANTIZED:
        return None
    *lead, k = x.shape
    out = _quantized_kernel(x.reshape(-1, k), weight, scales, biases, group_size, bits, mode)
    return None if out is None else out.reshape(*lead, out.shape[-1])


class SplitRows:
    """A 4-bit layer's rows through lockstep's own kernels, the launch for each (x shape, x
    dtype, canonical or plain), decided once each by custom/split_rows.py (which kernel);
    None where no kernel of lockstep's takes the call (the layer's own path then runs it)."""

    def __init__(self, n: int, k: int, mode: str, bits: int, group_size: int):
        self.n, self.k, self.mode, self.bits, self.group_size = n, k, mode, bits, group_size
        self.launches = {}

    @classmethod
    def for_layer(cls, layer, canonical: bool = True):
        """The layer's SplitRows, or None where the kernels are not for it (format, size;
        canonical False: where none is for its plain calls)."""
        mode = getattr(layer, "mode", "affine")
        weight = layer["weight"]
        k = weight.shape[-1] * 32 // layer.bits if weight.ndim == 2 else 0
        n = weight.shape[0]
        if not custom.split_rows.takes_layer(n, k, mode, layer.bits, layer.group_size, canonical):
            return None
        return cls(n, k, mode, layer.bits, layer.group_size)

    def __call__(self, layer, x: mx.array, canonical: bool = False):
        key = (x.shape, x.dtype, canonical)
        launch = self.launches.get(key, False)
        if launch is False:
            weight, scales, biases = layer["weight"], layer["scales"], layer.get("biases")
            kernel = custom.split_rows.kernel_for(self.n, self.k, self.mode, x.dtype, math.prod(x.shape[:-1]),
                                                  canonical)
            launch = self.launches[key] = None if kernel is None else kernel.launch_for(
                x.shape[:-1], self.n, self.k, self.mode, self.bits, self.group_size, x.dtype, weight.dtype,
                weight.shape[1], scales.dtype, None if biases is None else biases.dtype)
        if launch is None:
            return None
        if self.mode == "affine":
            return launch(x, layer["weight"], layer["scales"], layer["biases"])
        return launch(x, layer["weight"], layer["scales"])


def _mask_row(mask, b: int, i: int, end: int):
    """Row i (keys [0, end)) of an explicit mask; None for no mask or "causal", because a
    query restricted to its own key range needs none, and decode passes none."""
    if mask is None or isinstance(mask, str):
        return None
    if mask.ndim >= 3 and mask.shape[0] > 1:
        mask = mask[b : b + 1]
    return mask[..., i : i + 1, :end]


def attention_per_query(sdpa, queries, keys, values, *, mask=None, contiguous: bool = False,
                        **kwargs) -> mx.array:
    """Attention where the query at absolute position p attends keys [0, p] alone.

    queries (B, H, T, D) are the last T positions of keys/values (B, Hkv, S, D), as after
    a KV-cache update. `sdpa(q, k, v, mask=..., **kwargs)` is the model's own attention
    function, so each call is exactly the one decode makes at that position.
    """
    batch, _, t, _ = queries.shape
    total = keys.shape[2]
    first = total - t

    def upto(x, b, end):
        # Decode passes the cache's keys as they are; so do we wherever the range is all.
        return x if batch == 1 and end == total else x[b : b + 1, :, :end]

    per_batch = []
    for b in range(batch):
        outs = []
        for i in range(t):
            end = first + i + 1
            q = queries if batch == 1 and t == 1 else queries[b : b + 1, :, i : i + 1]
            k, v = upto(keys, b, end), upto(values, b, end)
            if contiguous:
                q, k, v = mx.contiguous(q), packed_kv(k), packed_kv(v)
            outs.append(sdpa(q, k, v, mask=_mask_row(mask, b, i, end), **kwargs))
        per_batch.append(outs[0] if t == 1 else mx.concatenate(outs, axis=2))
    return per_batch[0] if batch == 1 else mx.concatenate(per_batch, axis=0)
