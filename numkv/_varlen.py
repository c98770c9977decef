"""``numkv.varlen_attention`` and ``numkv.paged_attention``: many sequences
packed along one token axis (flash-attention's varlen convention), keys
packed the same way or read from pages through a block table.

Named dims: ``N`` sequences, ``Tq`` / ``Tk`` packed query / key rows, ``Hq``,
``Hkv``, ``D``, ``Dv`` as in ``numkv.attention``; sequence ``i`` owns query
rows ``cu_seqlens_q[i]:cu_seqlens_q[i + 1]``.

coerce -> validate everything (before any work) -> one ``AttentionCall``
over the packed rows (``sequences``: each sequence's first query row, query
count and first key row; ``valid`` its key count, ``offset`` the bottom-right
causal offset of flash-attention) -> one launch of ``numkv.attention``'s
kernel -> Y ``(Tq, Hq, Dv)``.

Each sequence costs the pairs it attends (never the packed total squared),
and the work items of every sequence -- a long prompt's query tiles, each
decode's kv heads or key chunks -- share numkv's threads, claimed one at a
time.  The Python of a call does not grow with the sequences but for
NumPy's work on their offsets (docs/design.md, "Many sequences").
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np

from . import _attention, _config
from ._dtypes import NO_BYTES, block_bytes, is_float8_dtype, is_integer_dtype
from ._quantize import QuantizedArray, kernel_array
from ._validate import as_array

if TYPE_CHECKING:
    from numpy.typing import ArrayLike


def varlen_attention(Q: ArrayLike, K: ArrayLike, V: ArrayLike, cu_seqlens_q: ArrayLike, cu_seqlens_k: ArrayLike,
                     *, scale: float | None = None, is_causal: bool = False, softcap: float = 0.0,
                     left_window_size: int = -1, right_window_size: int = -1,
                     sinks: ArrayLike | None = None, qk_precision: str | None = None) -> np.ndarray:
    """Attention over sequences packed along one token axis (flash-attention's
    ``flash_attn_varlen_func`` convention).

    Parameters
    ----------
    Q : array, shape ``(Tq, Hq, D)``
        Sequence ``i``'s queries are rows ``cu_seqlens_q[i]:cu_seqlens_q[i + 1]``.
    K, V : array, shape ``(Tk, Hkv, D)`` / ``(Tk, Hkv, Dv)``
        Sequence ``i``'s keys are rows ``cu_seqlens_k[i]:cu_seqlens_k[i + 1]``;
        ``Hq`` a multiple of ``Hkv`` (GQA).  The dtypes ``numkv.attention`` reads.
    cu_seqlens_q, cu_seqlens_k : int array, shape ``(N + 1,)``
        Non-decreasing offsets from 0 to ``Tq`` / ``Tk``.
    scale, softcap, left_window_size, right_window_size, sinks, qk_precision
        As in ``numkv.attention`` (``qk_precision="int8"`` needs quantised
        keys: ``paged_attention``'s pages).
    is_causal : bool
        Bottom-right: the last query of a sequence attends all its keys (query
        ``i`` of ``sq`` against ``sk`` keys sits at position ``sk - sq + i``);
        the windows count from the same positions.

    Returns
    -------
    Y : ndarray, shape ``(Tq, Hq, Dv)``
        Each sequence's rows equal ``numkv.attention`` on that sequence alone.
    """
    if qk_precision is not None:
        _attention._int8_query(Q, K, None, qk_precision)  # (raises: varlen_attention's K is never quantised)
    Q, K, V = (_packed(x, name) for x, name in ((Q, "Q"), (K, "K"), (V, "V")))
    if K.shape[0] != V.shape[0]:
        raise ValueError(f"K has {K.shape[0]} rows but V has {V.shape[0]}")
    attrs = dict(scale=scale, is_causal=is_causal, softcap=softcap, left_window_size=left_window_size,
                 right_window_size=right_window_size, sinks=sinks)
    key = _layout_key("varlen", (Q, K, V), attrs, K.shape[0] > 0)
    step = _step_key(key, (Q.shape[0], K.shape[0]), (cu_seqlens_q, cu_seqlens_k))
    plan = _attention._step_plans.get(step) if step is not None else None
    if plan is not None:  # a decode step's layers after the first: checked and derived by the first
        return _run_step(plan, Q, K, V)
    n = _sequences(cu_seqlens_q, cu_seqlens_k)
    cu_q = offsets(cu_seqlens_q, "cu_seqlens_q", Q.shape[0], "Q's total_q", n)
    cu_k = offsets(cu_seqlens_k, "cu_seqlens_k", K.shape[0], "K's total_k", n)
    # One call of the sequences' shapes: every argument checked before any work.
    first = _checked(key, lambda: _attention.prepare(_rows(Q, 0, 0), _rows(K, 0, 0), _rows(V, 0, 0),
                                                     nonpad_kv_seqlen=np.zeros(1, np.int64), **attrs))
    keys = np.diff(cu_k)
    return _run(_packed_call(first, _rows(Q, 0, Q.shape[0]), _rows(K, 0, K.shape[0]), _rows(V, 0, V.shape[0]),
                             cu_q, cu_k[:-1], keys, left_window_size, right_window_size), key, step)


def _packed_call(first, q, k, v, cu_q, first_keys, keys, left_window_size, right_window_size, pages=None):
    """The sequences as one call of the kernel (``AttentionCall.sequences``):
    ``first``, the checked call of their shapes, on the packed ``q``, ``k``
    and ``v`` (4-D views), sequence ``i``'s queries rows ``cu_q[i]:cu_q[i +
    1]``, its keys ``keys[i]`` from row ``first_keys[i]`` (or from its row
    of the block table ``pages``); causal bottom-right, windows from the
    same positions."""
    queries = np.diff(cu_q)
    sequences = np.empty((len(queries), 3), np.int64)  # (np.stack: 3x the time)
    sequences[:, 0], sequences[:, 1], sequences[:, 2] = cu_q[:-1], queries, first_keys
    longest = int((keys + queries).max(initial=0))  # (a window this long or longer excludes nothing)
    return dataclasses.replace(  # (``first``'s past: none)
        first, q=q, k=k, v=v, offset=keys - queries, valid=keys, sequences=sequences, pages=pages,
        keys=int(keys.max(initial=0)),
        left=_attention._window(left_window_size, "left_window_size", longest),
        right=_attention._window(right_window_size, "right_window_size", longest))


# A serving loop calls with the same layout step after step (the same
# heads, dtypes, attributes and sequence count; a key more each): its
# arguments' checks (``first``, in ``_attention._checks``) and the kernel's
# layout (``_attention._layouts``) are kept under ``_layout_key``'s key.  A call
# of 8 one-token decodes over 10 keys each, float32, Hq16/Hkv4/D64, mostly
# Python: 205 us against 364 on 1 thread, 142 against 282 on 2 (a 2-vCPU
# Zen 3; docs/performance.md, session 25).
def _layout_key(kind, arrays, attrs, has_keys):
    """The key of a packed call's kept checks and layout, or None where it
    takes none: Q and the keys and values (packed, or the page pools) must be
    aligned, writeable, C-contiguous ndarrays or QuantizedArrays of a format
    with no separate scale (whose storage is), the attributes plain values
    (sinks a float64 vector, by value).  Everything but their leading axis's
    length (the token count or the pool's pages, which the layout does not
    depend on) is in the key, and whether there are keys at all (none: no
    loops compiled)."""
    if _config.REFERENCE:
        return None
    parts = []
    for x in arrays:
        form, x = _attention.kept_operand(x)
        if x is None:
            return None
        flags = x.flags
        if not (flags.c_contiguous and flags.aligned and flags.writeable):  # (read-only: another numba type)
            return None
        parts.append((form, x.shape[1:], x.strides, x.dtype))  # (strides: ``x[None]``'s first is 0)
    *values, sinks = attrs.values()
    attributes = _attention._attributes_key(tuple(values), sinks)
    return None if attributes is None else (kind, tuple(parts), attributes, has_keys)


def _step_key(key, rows, arrays):
    """The key of the plan the later layers of a decode step repeat (kept
    in ``_attention._step_plans``): the layout's ``key``, the packed
    ``rows`` (and a pool's pages), the sequences' ``arrays`` by value
    (ndarrays only: their checks passed before), the thread thresholds; or
    None."""
    if key is None:
        return None
    values = []
    for arr in arrays:
        if type(arr) is not np.ndarray:
            return None
        values.append((arr.dtype, arr.shape, arr.tobytes()))
    return key, rows, tuple(values), _attention._thresholds()


def _run_step(plan, Q, K, V):
    """Y of a kept step's ``plan`` for packed Q, K and V (or page pools):
    whole C-contiguous blocks, as ``_layout_key`` keeps."""
    return plan.run([block_bytes(kernel_array(x)) for x in (Q, NO_BYTES, K, NO_BYTES, V)])


def _checked(key, prepare):
    """``prepare()`` (the call of the sequences' shapes, every argument
    checked), or the one kept under ``key`` (``_attention._checks``)."""
    first = _attention._checks.get(key) if key is not None else None
    if first is None:
        first = prepare()
        if key is not None:
            _attention.keep_checks(key, first)
    return first


def _run(call, key=None, step=None):
    """Y ``(Tq, Hq, Dv)`` of a packed call: one launch of the kernel over
    every sequence (its layout kept under ``key``, its plan under
    ``step``), or (``NUMKV_REFERENCE``) the NumPy path on each alone."""
    if not _config.REFERENCE:
        return _attention.run(call, key=step, layout_key=key)
    from ._reference import attention_reference

    y = np.empty((call.q.shape[2], call.q.shape[1], call.v.shape[3]), call.out_dtype)
    for i, (q0, sq, k0) in enumerate(call.sequences.tolist()):
        if not sq:
            continue
        keys = int(call.valid[i])
        if call.pages is None:
            k, v = call.k[:, :, k0:k0 + keys], call.v[:, :, k0:k0 + keys]
        else:  # the simple path gathers the pages into a copy
            table = call.pages[i, :-(-keys // call.k.shape[2])]
            k, v = _gather(call.k, table, keys), _gather(call.v, table, keys)
        alone = dataclasses.replace(call, q=call.q[:, :, q0:q0 + sq], k=k, v=v, offset=call.offset[i:i + 1],
                                    valid=call.valid[i:i + 1], sequences=None, pages=None, keys=0)
        y[q0:q0 + sq] = alone.finish(attention_reference(alone)[0])[0].transpose(1, 0, 2)
    return y


def _rows(x, start, stop):
    """Rows ``start:stop`` of a packed ``(T, H, D)`` array as a ``(1, H, S, D)`` view."""
    return x[start:stop].transpose(1, 0, 2)[None]


def _packed(x, name):
    if type(x) is QuantizedArray:
        raise TypeError(f"{name} is a QuantizedArray: varlen_attention takes float arrays "
                        f"(quantised keys and values: paged_attention's pages)")
    x = as_array(x, name, sequences=False)
    if x.ndim != 3:
        raise ValueError(f"{name} must be 3-D (total_tokens, heads, head_size), got shape {x.shape}")
    return x


def _sequences(cu_seqlens_q, cu_seqlens_k):
    """The number of sequences, from ``cu_seqlens_q`` (``cu_seqlens_k``'s length must agree)."""
    lengths = []
    for value, name in ((cu_seqlens_q, "cu_seqlens_q"), (cu_seqlens_k, "cu_seqlens_k")):
        arr = as_array(value, name)
        if arr.ndim != 1 or arr.size < 1:
            raise ValueError(f"{name} must be 1-D of length num_sequences + 1 >= 1, got shape {arr.shape}")
        lengths.append(arr.size)
    if cu_seqlens_k is not None and lengths[0] != lengths[1]:
        raise ValueError(f"cu_seqlens_q has {lengths[0]} entries but cu_seqlens_k has {lengths[1]}: "
                         f"one offset per sequence boundary in both")
    return lengths[0] - 1


def offsets(value, name, total, total_name, n):
    """``value`` as int64 offsets ``(n + 1,)``: from 0, non-decreasing, ending at ``total``."""
    arr = as_array(value, name)
    if not is_integer_dtype(arr.dtype):
        raise TypeError(f"{name} must be an integer array, got dtype {arr.dtype}")
    if arr.shape != (n + 1,):
        raise ValueError(f"{name} must have shape ({n + 1},), got {arr.shape}")
    arr = arr.astype(np.int64)
    if arr[0] != 0:
        raise ValueError(f"{name}[0] must be 0, got {int(arr[0])}")
    if (arr[1:] < arr[:-1]).any():  # (the index found only then: a decode step's call is mostly overhead)
        i = int(np.flatnonzero(arr[1:] < arr[:-1])[0])
        raise ValueError(f"{name} must be non-decreasing: {name}[{i + 1}] = {int(arr[i + 1])} < "
                         f"{name}[{i}] = {int(arr[i])}")
    if arr[-1] != total:
        raise ValueError(f"{name}[-1] = {int(arr[-1])} does not match {total_name} {total}")
    return arr


def paged_attention(Q: ArrayLike, key_cache, value_cache, block_table: ArrayLike, seq_lens: ArrayLike,
                    cu_seqlens_q: ArrayLike, *, scale: float | None = None, is_causal: bool = False,
                    softcap: float = 0.0, left_window_size: int = -1, right_window_size: int = -1,
                    sinks: ArrayLike | None = None, qk_precision: str | None = None) -> np.ndarray:
    """Attention of packed queries over keys and values held in pages (a
    paged KV cache, vLLM's and flash-attention's layout), read in place.

    Parameters
    ----------
    Q : array, shape ``(Tq, Hq, D)``
        Sequence ``i``'s queries are rows ``cu_seqlens_q[i]:cu_seqlens_q[i + 1]``.
    key_cache, value_cache : array or QuantizedArray, shape ``(num_blocks, block_size, Hkv, D)`` / ``(..., Dv)``
        The page pool: token ``t`` of sequence ``i`` sits in page
        ``block_table[i, t // block_size]``, row ``t % block_size``.  Any K/V
        dtype ``numkv.attention`` reads, QuantizedArray pages included (any of
        ``numkv.quantize``'s formats); never gathered into a copy.
    block_table : int array, shape ``(N, max_blocks)``
        Entries past a sequence's last page are not read (-1 is fine there).
    seq_lens : int array, shape ``(N,)``
        Sequence ``i`` attends its first ``seq_lens[i]`` keys.
    cu_seqlens_q : int array, shape ``(N + 1,)``
    scale, is_causal, softcap, left_window_size, right_window_size, sinks, qk_precision
        As in ``varlen_attention`` (causal bottom-right: query ``j`` of ``sq``
        sits at position ``seq_lens[i] - sq + j``); ``qk_precision="int8"``
        with quantised pages: as in ``numkv.attention``.

    Returns
    -------
    Y : ndarray, shape ``(Tq, Hq, Dv)``
        Each sequence's rows equal ``numkv.attention`` on its keys alone.
    """
    Q = _packed(Q, "Q")
    if qk_precision is not None:  # attention over the dequantised int8 query, in Q's dtype
        y = paged_attention(_attention._int8_query(Q, key_cache, None, qk_precision), key_cache, value_cache,
                            block_table, seq_lens, cu_seqlens_q, scale=scale, is_causal=is_causal, softcap=softcap,
                            left_window_size=left_window_size, right_window_size=right_window_size, sinks=sinks)
        return y if is_float8_dtype(Q.dtype) or y.dtype == Q.dtype else y.astype(Q.dtype)
    pool_k, pool_v = _pages(key_cache, "key_cache"), _pages(value_cache, "value_cache")
    if pool_k.shape[:3] != pool_v.shape[:3]:
        raise ValueError(f"key_cache has (num_blocks, block_size, kv_heads) {pool_k.shape[:3]} but value_cache "
                         f"{pool_v.shape[:3]}")
    num_blocks, block_size = pool_k.shape[0], pool_k.shape[1]
    if block_size < 1:
        raise ValueError(f"key_cache's block_size must be >= 1, got {block_size}")
    if num_blocks < 1:
        raise ValueError("key_cache holds no blocks (num_blocks 0): a page pool holds one or more")
    attrs = dict(scale=scale, is_causal=is_causal, softcap=softcap, left_window_size=left_window_size,
                 right_window_size=right_window_size, sinks=sinks)
    key = _layout_key("paged", (Q, pool_k, pool_v), attrs, True)
    step = _step_key(key, (Q.shape[0], num_blocks, pool_v.shape[0]), (block_table, seq_lens, cu_seqlens_q))
    plan = _attention._step_plans.get(step) if step is not None else None
    if plan is not None:  # a decode step's layers after the first: checked and derived by the first
        return _run_step(plan, Q, pool_k, pool_v)
    table = as_array(block_table, "block_table")
    if not is_integer_dtype(table.dtype):
        raise TypeError(f"block_table must be an integer array, got dtype {table.dtype}")
    if table.ndim != 2:
        raise ValueError(f"block_table must be 2-D (num_sequences, max_blocks), got shape {table.shape}")
    n = table.shape[0]
    lengths = as_array(seq_lens, "seq_lens")
    if not is_integer_dtype(lengths.dtype):
        raise TypeError(f"seq_lens must be an integer array, got dtype {lengths.dtype}")
    if lengths.shape != (n,):
        raise ValueError(f"seq_lens must have shape (num_sequences,) = ({n},) (block_table's rows), "
                         f"got {lengths.shape}")
    lengths = lengths.astype(np.int64)
    cu_q = offsets(cu_seqlens_q, "cu_seqlens_q", Q.shape[0], "Q's total_q", n)
    if (lengths < 0).any():
        i = int(np.flatnonzero(lengths < 0)[0])
        raise ValueError(f"seq_lens[{i}] = {int(lengths[i])} is negative")
    needed = -(-lengths // block_size)  # pages each sequence reads
    if n and int(needed.max()) > table.shape[1]:
        i = int(np.argmax(needed))
        raise ValueError(f"block_table is too short: seq_lens[{i}] = {int(lengths[i])} needs {int(needed[i])} "
                         f"blocks of {block_size}, block_table has {table.shape[1]} a row")
    table = table.astype(np.int64)
    used = np.arange(table.shape[1]) < needed[:, None]  # the entries the sequences read
    bad = np.argwhere(used & ((table < 0) | (table >= num_blocks)))
    if bad.size:
        i, p = (int(x) for x in bad[0])
        raise ValueError(f"block_table[{i}, {p}] = {int(table[i, p])} is outside the pool's blocks "
                         f"[0, {num_blocks})")
    k_all, v_all = _pool_view(pool_k), _pool_view(pool_v)  # (num_blocks, Hkv, block_size, D): no copy
    # One call of the sequences' shapes (keys of page 0 stand in): every argument checked before any work.
    first = _checked(key, lambda: _attention.prepare(_rows(Q, 0, 0), k_all[:1, :, :0], v_all[:1, :, :0],
                                                     nonpad_kv_seqlen=np.zeros(1, np.int64), **attrs))
    return _run(_packed_call(first, _rows(Q, 0, Q.shape[0]), k_all, v_all, cu_q, np.zeros(n, np.int64), lengths,
                             left_window_size, right_window_size, pages=table), key, step)


def _pages(x, name):
    if type(x) is QuantizedArray:
        if x.ndim != 4:
            raise ValueError(f"{name} must be 4-D (num_blocks, block_size, kv_heads, head_size), got {x.shape}")
        return x
    x = as_array(x, name, sequences=False)
    if x.ndim != 4:
        raise ValueError(f"{name} must be 4-D (num_blocks, block_size, kv_heads, head_size), got shape {x.shape}")
    return x


def _pool_view(x):
    """The pool ``(num_blocks, block_size, Hkv, D)`` as ``(num_blocks, Hkv,
    block_size, D)``: attention's 4-D order, a view (a QuantizedArray's storage
    transposed the same way)."""
    if type(x) is QuantizedArray:
        scale = x._scale
        if scale is not None and np.ndim(scale) == 4:
            scale = scale.transpose(0, 2, 1, 3)
        return QuantizedArray(x.format, x.storage.transpose(0, 2, 1, 3), scale,
                              _shape=(x.shape[0], x.shape[2], x.shape[1], x.shape[3]))
    return x.transpose(0, 2, 1, 3)


def _gather(pool, pages, keys):
    """Keys ``0 .. keys`` of a ``(num_blocks, Hkv, block_size, D)`` pool view, as ``(1, Hkv, keys, D)``."""
    blocks = [pool[int(p)] for p in pages]
    blocks = [b.dequantize() if type(b) is QuantizedArray else np.asarray(b) for b in blocks]
    if not blocks:
        return np.zeros((1, pool.shape[1], 0, pool.shape[3]), np.float32)
    return np.concatenate(blocks, axis=1)[None, :, :keys]
