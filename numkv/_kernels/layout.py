"""The contract between the attention wrapper (``numkv._attention.run``) and
the kernels: which slot of ``ints``, row of ``desc`` and column of ``floats``
holds what, the dtype codes, and the table of narrow-float parameters.

The wrapper fills these by name; the kernels read them by index.  They are
defined once, here, and imported by both sides (``numkv._kernels.attention``
re-exports them).  Plain Python: no numba, nothing compiled.
"""

import numpy as np

from .. import _formats

# -- ints[]: shapes, masking rules, the plan ---------------------------------------
INT_FIELDS = (
    "batch", "q_heads", "kv_heads", "q_len", "total", "past", "head_size", "v_head_size",
    "causal", "left", "right", "has_mask",
    "block_q", "block_k", "n_q_tiles", "n_units", "chunk", "n_chunks", "gemm_rows",
    "sequences", "page_size", "pages", "pages_per_row", "heads_per_item",
)
(BATCH, Q_HEADS, KV_HEADS, Q_LEN, TOTAL, PAST, HEAD_SIZE, V_HEAD_SIZE,
 CAUSAL, LEFT, RIGHT, HAS_MASK,
 BLOCK_Q, BLOCK_K, N_Q_TILES, N_UNITS, CHUNK, N_CHUNKS, GEMM_ROWS,
 SEQUENCES, PAGE_SIZE, PAGES, PAGES_PER_ROW, HEADS_PER_ITEM) = range(len(INT_FIELDS))
# ``heads_per_item``: the kv heads a work item covers, 1 or all of them (keys
# that lie token-major, read in place by decode's loops, which take a key's
# row for every head at once: ``decode_loops._score_keys_heads``).
# Packed sequences (``numkv.varlen_attention``, ``numkv.paged_attention``):
# batch row ``b`` is sequence ``b``, whose first query row, query count and
# first key row are ``ints[ints[SEQUENCES] + SEQUENCE_FIELDS * b + ...]``
# (``sequences`` 0: a plain batch); Q, K, V and Y are then single packed
# rows (stride_b 0), offset by those rows.  Paged keys (``page_size`` > 0):
# key ``j`` of sequence ``b`` is row ``j % page_size`` of page
# ``ints[ints[PAGES] + b * pages_per_row + j // page_size]``, K and V's
# batch index.
SEQUENCE_FIELDS = ("first_query", "queries", "first_key")
FIRST_QUERY, QUERIES, FIRST_KEY = range(len(SEQUENCE_FIELDS))

# -- desc[]: a row per tensor, its base offset, (b, h, s, d) strides in elements, dtype code
TENSORS = ("q", "past_k", "k", "past_v", "v", "mask", "y")
T_Q, T_PAST_K, T_K, T_PAST_V, T_V, T_MASK, T_Y = range(len(TENSORS))
# ``in_place``: 1 where the kernel reads the K / V rows where they lie
# (``loop_functions.read_in_place``), 0 where it widens them into tiles.
TENSOR_FIELDS = ("base", "stride_b", "stride_h", "stride_s", "stride_d", "dtype", "in_place")
BASE, STRIDE_B, STRIDE_H, STRIDE_S, STRIDE_D, DTYPE, IN_PLACE_ROWS = range(len(TENSOR_FIELDS))

# -- floats[] ------------------------------------------------------------------------
FLOAT_FIELDS = ("q_scale", "score_scale", "softcap")
Q_SCALE, SCORE_SCALE, SOFTCAP = range(len(FLOAT_FIELDS))

# -- dtype codes (``numkv._dtypes.kernel_dtype_codes`` maps NumPy dtypes to them) ----
DTYPE_CODES = ("float32", "float64", "float16", "bfloat16", "float8_e4m3fn",
               "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu")
(F32, F64, F16, BF16, E4M3FN, E4M3FNUZ, E5M2, E5M2FNUZ, E8M0) = range(len(DTYPE_CODES))
# Quantised K/V (``numkv.QuantizedArray``), coded after the dtypes in the
# order of their records (``numkv._formats.FORMATS``: a format's code is
# its record's ``code``).  Their ``desc`` rows count bytes (base and
# strides; ``stride_d`` 1) and their rows are contiguous: a block format's
# blocks of ``QUANT_BLOCK`` elements (a float16 scale, maybe a float16
# minimum, then the codes), a given-scale format's codes alone, whose per-tensor or
# per-channel scales the wrapper folds into Q (keys) and Y (values).
QUANT_FORMATS = tuple(_formats.FORMATS)
assert _formats.FIRST_CODE == len(DTYPE_CODES)
QUANT_BLOCK = 32
# ``QUANT_TABLE[code - FIRST_QUANT]``: what the jitted loops read of a
# format's record -- elements and bytes a block, and the bytes of a run of
# ``QUANT_BLOCK`` elements (one block-widening step).
FIRST_QUANT = _formats.FIRST_CODE
QUANT_FIELDS = ("block", "block_bytes", "run_bytes")
Q_BLOCK, Q_BLOCK_BYTES, Q_RUN_BYTES = range(len(QUANT_FIELDS))
QUANT_TABLE = np.array([(f.block, f.block_bytes, QUANT_BLOCK // f.block * f.block_bytes)
                        for f in _formats.FORMATS.values()], np.int64).reshape(-1, len(QUANT_FIELDS))

# -- FORMAT_TABLE: the float8s widened by one parametrised loop -------------------
# The fnuz float8s (no infinities, one NaN pattern 0x80, no -0.0) as
# ``FORMAT_FIELDS``: a value's magnitude bits ``em`` shifted to float32's
# exponent/mantissa position, times 2**(127 - bias), is the value --
# subnormals included (a float32 subnormal times a power of two is exact);
# ``NONE`` marks a rule a format lacks.  (float16, float8_e4m3fn and
# float8_e5m2 have loops of their own, ``widen.FORMATS``: no row here.)
FORMAT_FIELDS = ("shift", "scale_exponent", "infnan_em", "nan_em", "nan_bits")
SHIFT, SCALE_EXPONENT, INFNAN_EM, NAN_EM, NAN_BITS = range(len(FORMAT_FIELDS))
NONE = 0xFFFFFFFF
FORMAT_ROWS = {
    E4M3FNUZ: (20, 119, NONE, NONE, 0x80),
    E5M2FNUZ: (21, 111, NONE, NONE, 0x80),
}
FORMAT_TABLE = np.zeros((len(DTYPE_CODES), len(FORMAT_FIELDS)), np.int64)
for _code, _row in FORMAT_ROWS.items():
    FORMAT_TABLE[_code] = _row
del _code, _row

# -- LOOP_FIELDS: the loops of each format, compiled on demand (``loop_functions``) --
# ``loops[code, field]``, the kernel's ``loops`` argument (one table per
# accumulation dtype): the address of the C function that scores keys of
# dtype ``code`` (``scores``), adds their values (``values``), or widens
# rows of it into a tile (``widen``); in the row of the accumulation dtype
# itself, the matrix products of many-row tiles (``gemm_scores``,
# ``gemm_values``) and the softmax of a tile of scores, for the loops and
# for those products (``softmax``, ``gemm_softmax``), and the output rows
# ``y = acc / l``, after merging a split key range's partial softmaxes
# (``finish``); decode's loops over every kv head of an item at once
# (``heads_scores``, ``heads_values``: ``HEADS_PER_ITEM``); 0 where not
# compiled (never called).
LOOP_FIELDS = ("scores", "values", "widen", "gemm_scores", "gemm_values", "softmax", "gemm_softmax", "finish",
               "heads_scores", "heads_values")
(SCORES, VALUES, WIDEN, GEMM_SCORES, GEMM_VALUES, SOFTMAX, GEMM_SOFTMAX, FINISH,
 HEADS_SCORES, HEADS_VALUES) = range(len(LOOP_FIELDS))
N_CODES = len(DTYPE_CODES) + len(QUANT_FORMATS)
