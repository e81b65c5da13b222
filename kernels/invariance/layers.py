"""Puts the canonical ops (kernels/invariance/ops.py) into a loaded mlx-lm model from outside.

Nothing in MLX or the mlx-lm model files is changed. Instead:
- each nn.Linear / nn.QuantizedLinear / nn.Embedding / nn.QuantizedEmbedding instance gets a
  subclass as its class (same parameters, same names, so weights and the parameter tree are
  untouched) whose call / as_linear routes M <= L rows through the canonical form;
- each MoE expert block of mlx-lm (`SwitchGLU`, `SwitchMLP`: the gather_mm / gather_qmm
  calls of their SwitchLinear / QuantizedSwitchLinear experts, dense or quantized in any
  mode) gets a subclass whose call runs M <= L token rows in the form the setting names
  (expert_rows.py: all rows in one unsorted call where the proof showed each (row, expert)
  element keeps its bits, else each row as its own call, the one a decode row makes): a row's
  expert matmuls then never depend on how many rows the router sends to an expert, nor on
  whether the rows are sorted by expert (mlx-lm sorts from 64 (row, expert) pairs up);
- the model's module namespace gets a wrapper in place of the `scaled_dot_product_attention`
  name it imported from mlx_lm.models.base;
- the model instance gets a subclass whose __call__ makes its setting (L, strategy) the
  active one on this thread for the duration of the forward pass. The attention wrapper is
  shared by every model of that family, so it reads the active setting rather than holding
  one; another model in the process runs native.
"""
import sys
import threading
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import wraps
import inspect

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import base as mlx_base
from mlx_lm.models.switch_layers import SwitchGLU, SwitchMLP

from . import expert_rows, word_lookup
from .composed_attention import composed_attention, composed_serves
from .cache_check import is_positional
from .prefill_attention import blocked_causal, wants_blocks
from .. import custom
from .sibling_rows import SiblingRows
from .ops import (SplitRows, Strategy, attention_per_query, dense_rows, dense_rows_in_one_launch, packed_kv,
                  quantized_rows, quantized_rows_in_one_launch, rows_of)


@dataclass(frozen=True)
class Setting:
    call_rows: int  # L: the most rows one kernel call may hold, each row its one-row bits (M > L: native)
    strategy: Strategy
    # MoE expert rows: the widest call run as one unsorted gather call per projection (proven by
    # expert_rows.prove_one_call; a wider call, one per block of this many rows); 0: per row
    expert_call_rows: int = 0
    # What each layer kind does with a call, worked out once here rather than per call
    # (the linears' host cost is per layer per token): the model's own call (native), and
    # whether one row is the plain op (every form but the skinny kernel's; mma_rows: per layer).
    dense_native: bool = field(init=False)
    dense_row_plain: bool = field(init=False)
    quantized_native: bool = field(init=False)
    quantized_row_plain: bool = field(init=False)

    def __post_init__(self):
        st = self.strategy
        object.__setattr__(self, "dense_native", st.dense == "native")
        object.__setattr__(self, "dense_row_plain", st.dense not in ("skinny", "mma_rows"))
        object.__setattr__(self, "quantized_native", st.quantized_rows == 0)
        object.__setattr__(self, "quantized_row_plain", st.quantized_form != "skinny")  # qmv_rows: plain


class _ThreadState(threading.local):
    # class attributes: every thread starts from these, and a read is one attribute lookup
    active: "Setting | None" = None  # what the layers read: kept by _thread_value
    setting: "Setting | None" = None
    native: bool = False
    blocks: bool = False  # calls of more than L rows run canonically in blocks of at most L rows


_local = _ThreadState()


def active_setting() -> Setting | None:
    return _local.active


def _update_active() -> None:
    _local.active = None if _local.native else _local.setting


@contextmanager
def _thread_value(name: str, value):
    """`name` on this thread's state is `value` for the enclosed calls, then what it was."""
    previous = getattr(_local, name)
    setattr(_local, name, value)
    _update_active()
    try:
        yield
    finally:
        setattr(_local, name, previous)
        _update_active()


def batch_invariant(setting: Setting | None):
    """Make `setting` the active one on this thread (None: native) for the enclosed calls."""
    return _thread_value("setting", setting)


def calls_in_blocks():
    """The enclosed calls of more than L rows run canonically, as blocks of at most L rows each
    (every row keeps the bits of its single-row call: the canonical forms are row-independent
    within a call the self-test proved). For the engine's decode passes, whose deterministic
    rows may outnumber L; a prompt chunk keeps its own shape (its native call: chunks are
    aligned, so the same chunk has the same shape alone or after a cached prefix)."""
    return _thread_value("blocks", True)


def _in_blocks(x: mx.array, call_rows: int, call) -> mx.array:
    """`call` (rows (M, K) -> (M, N)) on x's rows in blocks of at most `call_rows`, in order."""
    k = x.shape[-1]
    rows = x.reshape(-1, k)
    out = mx.concatenate([call(rows[i:i + call_rows]) for i in range(0, rows.shape[0], call_rows)], axis=0)
    return out.reshape(*x.shape[:-1], out.shape[-1])


def native_forms():
    """The enclosed model calls run natively even where a setting is installed: for passes
    that hold no row needing the guarantee (the engine's passes of non-deterministic rows),
    where canonical forms would only cost time."""
    return _thread_value("native", True)


def call_without_head(model, inputs: mx.array, cache) -> mx.array:
    """The model's body on `inputs` (1, T), writing `cache`, without the output head (for
    prompt chunks, whose logits are never used), under the model's batch-invariance setting
    as in its own call. A model with no separate body runs whole. Returns the body's output:
    evaluating it with the caches runs everything the pass needs (a pipeline stage's send to
    the next is in its graph, not in the caches')."""
    body = getattr(model, "model", None)
    if not callable(body):
        return model(inputs, cache=cache)
    with batch_invariant(getattr(model, "_lockstep_setting", None)):
        return body(inputs, cache=cache)


# The four layer classes below run on every linear of every token: one attribute read and
# the row count, then the op (a one-row call under a setting whose row is the plain op is
# exactly the native op: decode pays ~nothing on the host beyond nn.Linear's own call).
# `x.size == x.shape[-1]`: one row. The base classes are called by name: super() costs host
# time on every linear (
# bench/results/history/2026-12-01-h200-attention-warps-host-cost-4bit-floor.md).
_linear_call = nn.Linear.__call__
_quantized_linear_call = nn.QuantizedLinear.__call__
_embedding_as_linear = nn.Embedding.as_linear
_quantized_embedding_as_linear = nn.QuantizedEmbedding.as_linear


def _canonical(x, call_rows: int, call):
    """`call(x)` for a call of at most `call_rows` rows; under `calls_in_blocks` a wider call runs
    in blocks of at most `call_rows` rows (its callers first try it as one launch of a kernel whose
    rows do not depend on the call's width); None: the call is wider than L and runs natively
    (a prompt chunk)."""
    if rows_of(x) <= call_rows:
        return call(x)
    if not _local.blocks:
        return None
    return _in_blocks(x, call_rows, call)


def _dense_canonical(x, weight, s: Setting):
    """_canonical for a dense weight (N, K) under `s`'s dense form."""
    form = s.strategy.dense
    if _local.blocks and rows_of(x) > s.call_rows:  # a wide deterministic call: one launch where it can
        y = dense_rows_in_one_launch(x, weight, form)
        if y is not None:
            return y
    return _canonical(x, s.call_rows, lambda r: dense_rows(r, weight, form))


class InvariantLinear(nn.Linear):
    def __call__(self, x):
        s = _local.active
        if s is None or s.dense_native:
            return _linear_call(self, x)
        if x.size == x.shape[-1] and s.dense_row_plain:
            y = x @ self["weight"].T  # (not addmm: the bias is a separate add for every M)
        else:
            y = _dense_canonical(x, self["weight"], s)
            if y is None:
                return _linear_call(self, x)
        return y + self["bias"] if "bias" in self else y


def _quantized_canonical(x, layer, s: Setting):
    """_canonical for a quantized layer under `s`'s quantized form."""
    args = (layer["weight"], layer["scales"], layer.get("biases"))
    if _local.blocks and rows_of(x) > s.call_rows:  # a wide deterministic call: one launch where it can
        y = quantized_rows_in_one_launch(x, *args, group_size=layer.group_size, bits=layer.bits, mode=layer.mode,
                                         form=s.strategy.quantized_form)
        if y is not None:
            return y
    kw = dict(group_size=layer.group_size, bits=layer.bits, mode=layer.mode, form=s.strategy.quantized_form)
    return _canonical(x, s.call_rows, lambda r: quantized_rows(r, *args, rows_per_call=s.strategy.quantized_rows, **kw))


def _split(layer, x, s):
    """A 4-bit layer's rows through lockstep's kernels: plain calls of a few rows, and every
    call a setting makes canonical (its rows at any width: the kernels' rows never depend on
    it); None where they do not run them. A sibling group's launch (sibling_rows.py) first,
    else the layer's own (ops.SplitRows); custom/split_rows.py decides which plain calls."""
    if s is not None and (s.quantized_native or (rows_of(x) > s.call_rows and not _local.blocks)):
        return None  # the model's own calls, or a prompt chunk (its native call)
    if layer._siblings is not None:
        y = layer._siblings(layer, x, canonical=s is not None)
        if y is not None:
            return y
    if layer._split_rows is None:
        return None
    return layer._split_rows(layer, x, canonical=s is not None)


class InvariantQuantizedLinear(nn.QuantizedLinear):
    _split_rows = None  # SplitRows, set by install for large 4-bit layers
    _siblings = None  # SiblingRows, set by install for q/k/v and gate/up groups one launch takes

    def __call__(self, x):
        s = _local.active
        if self._split_rows is not None or self._siblings is not None:
            y = _split(self, x, s)
            if y is not None:
                return y + self["bias"] if "bias" in self else y
        if s is None or s.quantized_native or (x.size == x.shape[-1] and s.quantized_row_plain):
            return _quantized_linear_call(self, x)
        y = _quantized_canonical(x, self, s)
        if y is None:
            return _quantized_linear_call(self, x)
        return y + self["bias"] if "bias" in self else y


class InvariantEmbedding(nn.Embedding):
    def as_linear(self, x):
        s = _local.active
        if s is None or s.dense_native or (x.size == x.shape[-1] and s.dense_row_plain):
            return _embedding_as_linear(self, x)
        y = _dense_canonical(x, self["weight"], s)
        return _embedding_as_linear(self, x) if y is None else y


class InvariantQuantizedEmbedding(nn.QuantizedEmbedding):
    _split_rows = None  # SplitRows, set by install for large 4-bit tables
    _siblings = None  # (never set: an embedding has no siblings)

    def __call__(self, x):
        return word_lookup.lookup(self, x)

    def as_linear(self, x):
        s = _local.active
        if self._split_rows is not None:
            y = _split(self, x, s)
            if y is not None:
                return y
        if s is None or s.quantized_native or (x.size == x.shape[-1] and s.quantized_row_plain):
            return _quantized_embedding_as_linear(self, x)
        y = _quantized_canonical(x, self, s)
        return _quantized_embedding_as_linear(self, x) if y is None else y


def _expert_rows(self, call, x, indices):
    """An MoE expert block's call: `call(self, x, indices)` (its own) unless the active setting
    covers the call's rows, else the rows in the setting's form (expert_rows.canonical); outputs
    (..., k, D) as the block's own. x: (..., D) hidden states, indices: (..., k) experts per row."""
    s = _local.active
    rows = x.size // x.shape[-1] if x.shape[-1] else 0
    if s is None or rows <= 1 or (rows > s.call_rows and not _local.blocks):
        return call(self, x, indices)
    return expert_rows.canonical(self, x, indices, s.expert_call_rows)


_switch_glu_call = SwitchGLU.__call__
_switch_mlp_call = SwitchMLP.__call__


class InvariantSwitchGLU(SwitchGLU):
    def __call__(self, x, indices):
        return _expert_rows(self, _switch_glu_call, x, indices)


class InvariantSwitchMLP(SwitchMLP):
    def __call__(self, x, indices):
        return _expert_rows(self, _switch_mlp_call, x, indices)


LAYER_SWAPS = {
    nn.Linear: InvariantLinear,
    nn.QuantizedLinear: InvariantQuantizedLinear,
    nn.Embedding: InvariantEmbedding,
    nn.QuantizedEmbedding: InvariantQuantizedEmbedding,
    SwitchGLU: InvariantSwitchGLU,
    SwitchMLP: InvariantSwitchMLP,
}
# The quantized layers, whose large 4-bit ones may run qmv_split (SplitRows).
QUANTIZED_SWAPS = (InvariantQuantizedLinear, InvariantQuantizedEmbedding)
# The MoE expert blocks: the SwitchLinear / QuantizedSwitchLinear experts they call are covered.
EXPERT_BLOCKS = expert_rows.EXPERT_BLOCKS
_LAYER_RESTORES = {v: k for k, v in LAYER_SWAPS.items()}

_NATIVE_SDPA = mlx_base.scaled_dot_product_attention
_SDPA_SIGNATURE = inspect.signature(_NATIVE_SDPA)
_SDPA_NAMES = tuple(_SDPA_SIGNATURE.parameters)
_SDPA_REQUIRED = frozenset(n for n, p in _SDPA_SIGNATURE.parameters.items() if p.default is inspect.Parameter.empty)


def _sdpa_arguments(args, kwargs) -> dict:
    """The attention call's arguments by name, as `_SDPA_SIGNATURE.bind(...).arguments`
    gives them (defaults left out), without inspect's bind on the common calls: it costs
    host time once per layer per pass (
    bench/results/history/2026-12-01-h200-attention-warps-host-cost-4bit-floor.md);
    anything unusual
    still goes through it (and its errors)."""
    if len(args) <= len(_SDPA_NAMES) and all(k in _SDPA_NAMES for k in kwargs):
        a = dict(zip(_SDPA_NAMES, args))
        if not any(k in a for k in kwargs):
            a.update(kwargs)
            if _SDPA_REQUIRED <= a.keys():
                return a
    return dict(_SDPA_SIGNATURE.bind(*args, **kwargs).arguments)


@wraps(_NATIVE_SDPA)
def invariant_sdpa(*args, **kwargs):
    """mlx-lm's attention, per query over exactly its key range when T <= L; a ragged pass
    (kernels/batching/ragged.py) comes back here once per request, with that request's own keys."""
    cache = kwargs.get("cache") if len(args) < 4 else args[3]
    attend = getattr(cache, "attend", None)
    if attend is not None:  # a ragged pass, or one request's pass over the KV pool: the cache attends
        a = _sdpa_arguments(args, kwargs)
        return attend(invariant_sdpa, a["queries"], scale=a["scale"], sinks=a.get("sinks"))
    s = active_setting()
    if s is not None and s.strategy.attention == "composed":
        a = _sdpa_arguments(args, kwargs)
        if (is_positional(a.get("cache")) and a["queries"].shape[2] <= s.call_rows
                and composed_serves(a.get("mask"), a.get("sinks"))):
            return composed_attention(a["queries"], a["keys"], a["values"], a["scale"])
    queries = args[0] if args else kwargs.get("queries")
    packed = s is not None and s.strategy.attention == "per_query_contiguous"
    if queries is not None and queries.shape[2] == 1:
        a = _sdpa_arguments(args, kwargs) if packed else {}
        if packed and is_positional(a.get("cache")):
            # decode gets the same packed layout as each row of a block
            a["queries"] = mx.contiguous(a["queries"])
            a["keys"], a["values"] = packed_kv(a["keys"]), packed_kv(a["values"])
            return _NATIVE_SDPA(**a)
        return _NATIVE_SDPA(*args, **kwargs)  # one query is already the call decode makes
    if s is not None and s.strategy.attention in ("per_query", "per_query_contiguous", "composed"):
        a = _sdpa_arguments(args, kwargs)
        q = a.pop("queries")
        # Per-query slicing is only meaningful on keys stored in position order.
        if q.shape[2] <= s.call_rows and is_positional(a.get("cache")):
            k, v, mask = a.pop("keys"), a.pop("values"), a.pop("mask", None)
            return attention_per_query(_NATIVE_SDPA, q, k, v, mask=mask, contiguous=packed, **a)
    if mx.default_device() == mx.cpu:  # a long prompt chunk on the CPU attends in blocks
        a = _sdpa_arguments(args, kwargs)
        if is_positional(a.get("cache")) and wants_blocks(a["queries"], a["keys"], a.get("mask")):
            q, k, v = a.pop("queries"), a.pop("keys"), a.pop("values")
            a.pop("mask")
            return blocked_causal(_NATIVE_SDPA, q, k, v, **a)
    return _NATIVE_SDPA(*args, **kwargs)


# module name -> {id(model): weak ref} of installed models using the wrapper there. Weak, so
# a model dropped without uninstall does not pin the wrapper; by id, as nn.Module (a dict)
# is unhashable.
_sdpa_users: dict[str, dict[int, weakref.ref]] = {}
_model_classes: dict[type, type] = {}


def _invariant_model_class(cls: type) -> type:
    if cls not in _model_classes:

        def __call__(self, *args, **kwargs):
            with batch_invariant(self._lockstep_setting):
                return cls.__call__(self, *args, **kwargs)

        _model_classes[cls] = type(
            cls.__name__, (cls,), {"__call__": __call__, "__module__": cls.__module__}
        )
    return _model_classes[cls]


def model_module_names(model) -> set[str]:
    """Python modules defining the classes the model is built from (where names like
    `scaled_dot_product_attention` were imported into)."""
    names = {type(m).__module__ for _, m in model.named_modules()}
    names.add(type(model).__module__)
    return {n for n in names if n in sys.modules}


def _wrap_attention(model, user) -> list[str]:
    """Put `invariant_sdpa` in place of the attention name in the model's modules, recording
    `user` there (the name goes back to native when no user is left). Returns the modules."""
    wrapped = []
    for name in model_module_names(model):
        module = sys.modules[name]
        if getattr(module, "scaled_dot_product_attention", None) in (_NATIVE_SDPA, invariant_sdpa):
            module.scaled_dot_product_attention = invariant_sdpa
            _sdpa_users.setdefault(name, {})[user] = weakref.ref(model)
            wrapped.append(name)
    return wrapped


def hook_attention(model) -> list[str]:
    """Route the model's attention name through `invariant_sdpa` whatever the strategy (ragged
    passes need it even at L = 0; with no active setting it is the native call). The module
    keeps the wrapper while this model lives. Returns the hooked module names."""
    return _wrap_attention(model, ("ragged", id(model)))


def install(model, setting: Setting) -> dict:
    """Swap the model's layers and attention name for canonical ones; returns counts."""
    if hasattr(model, "_lockstep_setting"):
        uninstall(model)
    model._lockstep_setting = setting
    model._lockstep_sdpa_modules = frozenset()
    if setting.strategy.is_native:
        return {}  # the model's own calls are the proven form: nothing to swap
    counts = {}
    for _, m in model.named_modules():
        swap = LAYER_SWAPS.get(type(m))
        if swap is not None:
            m.__class__ = swap
            counts[swap.__name__] = counts.get(swap.__name__, 0) + 1
            if swap in QUANTIZED_SWAPS:
                m._split_rows = SplitRows.for_layer(m)
                if m._split_rows is not None:
                    counts["split_rows"] = counts.get("split_rows", 0) + 1
    siblings = _attach_siblings(model)
    if siblings:
        counts["sibling_groups"] = siblings
    wrapped = _wrap_attention(model, id(model))
    counts["attention_modules"] = len(wrapped)
    # Plain attributes (not tuple/list/dict, which nn.Module would file as children).
    model._lockstep_sdpa_modules = frozenset(wrapped)
    model.__class__ = _invariant_model_class(type(model))
    return counts


def _attach_siblings(model) -> int:
    """Give each sibling group (q/k/v, gate/up) that one launch takes its SiblingRows, its
    layers the Invariant class; returns how many groups got one."""
    count = 0
    for layers in custom.split_rows.sibling_groups(model):
        if not all(type(layer) in (nn.QuantizedLinear, InvariantQuantizedLinear) for layer in layers):
            continue
        group = SiblingRows.for_group(layers)
        if group is None:
            continue
        for layer in layers:
            layer.__class__ = InvariantQuantizedLinear
            layer._siblings = group
        count += 1
    return count


def install_plain_kernels(model) -> dict:
    """With batch invariance off (L = 0): the large 4-bit layers (ops.SplitRows) get their
    Invariant class, so a plain call of at most split_rows.PLAIN_ROWS rows runs lockstep's
    kernels where they run (no setting is ever active: every call is plain), and sibling
    groups one launch takes theirs; their kernels are built now, not in the first passes.
    Quantized embeddings with one-byte scales get theirs for its lookup (word_lookup.py).
    `uninstall` gives the classes back. Returns the swapped counts."""
    from ..custom import qmv_split

    if hasattr(model, "_lockstep_setting"):
        uninstall(model)
    if not qmv_split.runs_here():
        return {}
    counts = {}
    for _, m in model.named_modules():
        swap = LAYER_SWAPS.get(type(m))
        if swap in QUANTIZED_SWAPS:
            split = SplitRows.for_layer(m, canonical=False)  # only layers whose plain calls run a kernel
            if split is not None:
                m.__class__ = swap
                m._split_rows = split
                counts["split_rows"] = counts.get("split_rows", 0) + 1
            elif swap is InvariantQuantizedEmbedding and word_lookup.looks_up_words(m):
                m.__class__ = swap  # its lookup alone
                counts["word_lookups"] = counts.get("word_lookups", 0) + 1
    siblings = _attach_siblings(model)
    if siblings:
        counts["sibling_groups"] = siblings
    if counts:
        model._lockstep_setting = None  # installed, no setting: uninstall restores the layers
        model._lockstep_sdpa_modules = frozenset()
        from ..custom.precompile import linear_shapes, precompile_for

        precompile_for(linear_shapes(model, dense="none"), range(1, custom.split_rows.PLAIN_ROWS + 1))
    return counts


def uninstall(model) -> None:
    """Give the model back its own classes and attention name (no-op if not installed)."""
    if not hasattr(model, "_lockstep_setting"):
        return
    for _, m in model.named_modules():
        original = _LAYER_RESTORES.get(type(m))
        if original is not None:
            m.__class__ = original
            m.__dict__.pop("_split_rows", None)
            m.__dict__.pop("_siblings", None)
    for name in model._lockstep_sdpa_modules:
        users = _sdpa_users.get(name)
        if users is not None:
            users.pop(id(model), None)
            for key in [k for k, ref in users.items() if ref() is None]:
                del users[key]
            if not users:
                del _sdpa_users[name]
                sys.modules[name].scaled_dot_product_attention = _NATIVE_SDPA
    if type(model) in _model_classes.values():
        model.__class__ = type(model).__mro__[1]
    del model._lockstep_setting
    del model._lockstep_sdpa_modules
