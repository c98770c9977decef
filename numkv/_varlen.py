"""``numkv.varlen_attention`` and ``numkv.paged_attention``: many sequences
packed along one token axis (flash-attention's varlen convention), keys
packed the same way or read from pages through a block table.

Named dims: ``N`` sequences, ``Tq`` / ``Tk`` packed query / key rows, ``Hq``,
``Hkv``, ``D``, ``Dv`` as in ``numkv.attention``; sequence ``i`` owns query
rows ``cu_seqlens_q[i]:cu_seqlens_q[i + 1]``.

coerce -> validate everything (before any work) -> per sequence, 4-D views
of its rows (no copy) -> ``numkv.attention``'s prepared call with
``nonpad_kv_seqlen`` = its key count (the bottom-right causal offset and
windows of flash-attention) -> its kernel -> Y's rows.

Each sequence is one call of ``numkv.attention``'s kernel, from a Python
loop (not one launch for the whole batch): its cost is the pairs that
sequence attends (never the packed total squared), and each call spreads
over numkv's threads by its own size -- a long prompt's query tiles, a long
decode's key chunks -- while a one-token decode of a short sequence stays on
the calling thread (``_config.SINGLE_THREAD_MACS``).  The price is Python
per sequence and layer: ~130-160 us on a 2-vCPU Zen 3 (1-32 one-token
sequences, 1 thread), ~60 of them ``prepare`` and ``run`` rebuilding the
kernel's arguments (a call with ``nonpad_kv_seqlen`` keeps no plan).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from . import _attention, _config
from ._dtypes import is_float8_dtype, is_integer_dtype
from ._quantize import QuantizedArray
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
    n = _sequences(cu_seqlens_q, cu_seqlens_k)
    cu_q = offsets(cu_seqlens_q, "cu_seqlens_q", Q.shape[0], "Q's total_q", n)
    cu_k = offsets(cu_seqlens_k, "cu_seqlens_k", K.shape[0], "K's total_k", n)
    attrs = dict(scale=scale, is_causal=is_causal, softcap=softcap, left_window_size=left_window_size,
                 right_window_size=right_window_size, sinks=sinks)
    # One call of the sequences' shapes: every argument checked before any work.
    first = _attention.prepare(_rows(Q, 0, 0), _rows(K, 0, 0), _rows(V, 0, 0),
                               nonpad_kv_seqlen=np.zeros(1, np.int64), **attrs)
    attrs["sinks"] = first.sinks
    y = np.empty((Q.shape[0], Q.shape[1], V.shape[2]), first.out_dtype)
    for i in range(n):
        q0, q1, k0, k1 = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
        if q1 == q0:
            continue
        call = _attention.prepare(_rows(Q, q0, q1), _rows(K, k0, k1), _rows(V, k0, k1),
                                  nonpad_kv_seqlen=np.array([k1 - k0], np.int64), **attrs)
        y[q0:q1] = _run(call)[0].transpose(1, 0, 2)
    return y


def _run(call):
    if _config.REFERENCE:
        from ._reference import attention_reference

        return call.finish(attention_reference(call)[0])
    return _attention.run(call)


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
    drops = np.flatnonzero(np.diff(arr) < 0)
    if drops.size:
        i = int(drops[0])
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
    for i in range(n):
        used = table[i, :needed[i]]
        bad = np.flatnonzero((used < 0) | (used >= num_blocks))
        if bad.size:
            p = int(bad[0])
            raise ValueError(f"block_table[{i}, {p}] = {int(used[p])} is outside the pool's blocks "
                             f"[0, {num_blocks})")
    attrs = dict(scale=scale, is_causal=is_causal, softcap=softcap, left_window_size=left_window_size,
                 right_window_size=right_window_size, sinks=sinks)
    k_all, v_all = _pool_view(pool_k), _pool_view(pool_v)  # (num_blocks, Hkv, block_size, D): no copy
    # One call of the sequences' shapes: every argument checked before any work.
    first = _attention.prepare(_rows(Q, 0, 0), k_all[:1, :, :0], v_all[:1, :, :0],
                               nonpad_kv_seqlen=np.zeros(1, np.int64), **attrs)
    attrs["sinks"] = first.sinks
    y = np.empty((Q.shape[0], Q.shape[1], pool_v.shape[3]), first.out_dtype)
    for i in range(n):
        q0, q1, keys = int(cu_q[i]), int(cu_q[i + 1]), int(lengths[i])
        if q1 == q0:
            continue
        # Checked as a call of the sequence's shapes (its keys of page 0 stand in), then pointed at the pool.
        call = _attention.prepare(_rows(Q, q0, q1), k_all[:1, :, :0], v_all[:1, :, :0],
                                  nonpad_kv_seqlen=np.zeros(1, np.int64), **attrs)
        call.k, call.v, call.pages, call.keys = k_all, v_all, table[i, :needed[i]], keys
        call.offset[:], call.valid[:] = keys - (q1 - q0), keys
        call.left = _attention._window(left_window_size, "left_window_size", keys + q1 - q0)
        call.right = _attention._window(right_window_size, "right_window_size", keys + q1 - q0)
        if _config.REFERENCE:
            y[q0:q1] = _paged_reference(call, table[i, :needed[i]])[0].transpose(1, 0, 2)
        else:
            y[q0:q1] = _attention.run(call)[0].transpose(1, 0, 2)
    return y


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


def _paged_reference(call, pages):
    """The NumPy path over the sequence's keys gathered from their pages
    (``NUMKV_REFERENCE``: the simple path, which may copy)."""
    import dataclasses

    from ._reference import attention_reference

    keys = call.keys
    k = _gather(call.k, pages, keys)
    v = _gather(call.v, pages, keys)
    plain = dataclasses.replace(call, k=k, v=v, pages=None, keys=0)
    return plain.finish(attention_reference(plain)[0])


def _gather(pool, pages, keys):
    """Keys ``0 .. keys`` of a ``(num_blocks, Hkv, block_size, D)`` pool view, as ``(1, Hkv, keys, D)``."""
    blocks = [pool[int(p)] for p in pages]
    blocks = [b.dequantize() if type(b) is QuantizedArray else np.asarray(b) for b in blocks]
    if not blocks:
        return np.zeros((1, pool.shape[1], 0, pool.shape[3]), np.float32)
    return np.concatenate(blocks, axis=1)[None, :, :keys]
