"""Spin-waiting for numkv's thread pool: a short wait on a flag, without the GIL.

Waking a sleeping thread costs 25-50 us on a virtual machine (measured: an
empty job handed to a pool worker came back in 115 us when the caller slept
until it was done, 27 us when the caller spun), so a caller that expects its
workers to finish soon spins first, with the CPU's pause hint, then sleeps;
and so does a worker whose jobs come close together (``signal_then_wait``).

A thread blocked on the GIL sleeps too: a worker that saw its job posted
while the caller still held the GIL, or a caller whose share ended while a
worker held it, lost ~25 us to it (decode Hq=16 Hkv=4 D=64 Skv=1088 on 2
threads: 78-86 us a call, against 57-61 without).  So a kernel run
``joined`` (``pool.run``) posts its workers' jobs itself, after the call
has let go of the GIL (``_post_jobs``), and its caller waits for them
before it takes the GIL back (``_join_workers``).  These two are written
as IR: as numba functions (inlined into the kernel, with their callees)
they cost a first call 0.3-0.5 s of compilation.
"""

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from .._config import jit
from .layout import CALLED_OFF, FLAG_SLOT, NOT_STARTED
from .simd import _emit_loop, _emit_pause, _load_acquire, _pause, _store_release

# sha256 of the sources of the modules this one compiles into its kernels
# (every ``numkv`` module it imports, and theirs): numba's disk cache
# notices edits to a kernel's own file only, and
# ``tests/test_kernel_layout.py`` fails, printing the new value, until this
# is updated after a helper changes (updating it makes numba recompile).
HELPERS_SHA256 = "7acff5e19a48f5adc68d83dfd321727e1d5f9def84efab61b205acc3b3b09567"

# How long a joined call's caller spins for its workers before it leaves the
# waiting to Python (which sleeps): as ``pool.SPIN_POLLS``.
JOIN_POLLS = 20_000


@jit()
def signal_then_wait(flags, signal_at, signal, index, value, spins):
    """``flags[signal_at] = signal`` (release: what the thread wrote before is
    visible to whoever reads it; none where ``signal_at < 0``), then whether
    ``flags[index] >= value`` within ``spins`` polls (~26 ns each) -- a
    caller waiting for its workers, or a worker that writes it finished a
    job and watches for the next.  (One function for both: each numba
    function costs ~0.13 s of a first call's compilation.)"""
    if signal_at >= 0:
        _store_release(flags, signal_at, signal)
    for _ in range(spins):
        if _load_acquire(flags, index) >= value:
            return True
        _pause()
    return False


def _flag_slots(context, builder, sig, args):
    """IR: the data pointers of ``flags`` and ``call``, the call's sequence
    number, its workers and the index of the first ``finished`` flag."""
    flags, call = (context.make_array(t)(context, builder, a) for t, a in zip(sig.args[:2], args[:2]))
    i64 = ir.IntType(64)
    workers = builder.sub(builder.extract_value(call.shape, 0), ir.Constant(i64, 1))
    half = builder.lshr(builder.extract_value(flags.shape, 0), ir.Constant(i64, 1))
    return flags.data, call.data, builder.load(call.data), workers, half


def _is_pool_arrays(flags, call):
    return all(isinstance(a, types.Array) and a.dtype == types.int64 and a.ndim == 1 for a in (flags, call))


@intrinsic
def _post_jobs(typingctx, flags, call):
    """A joined call's caller, first: ``flags[w * FLAG_SLOT] = call[0]``
    (release) for its workers ``w < call.size - 1``, which watch for it."""
    if not _is_pool_arrays(flags, call):
        return None

    def codegen(context, builder, sig, args):
        flags_at, _, sequence, workers, _ = _flag_slots(context, builder, sig, args)

        def post(worker, _):
            at = builder.gep(flags_at, [builder.mul(worker, ir.Constant(ir.IntType(64), FLAG_SLOT))])
            builder.store_atomic(sequence, at, "release", align=8)
            return []
        _emit_loop(builder, ir.Constant(ir.IntType(64), 0), workers, 1, [], post)
        return context.get_dummy_value()

    return types.void(flags, call), codegen


@intrinsic
def _join_workers(typingctx, flags, call, claimed):
    """A joined call's caller, last: for each worker, call it off where it
    has not started (``call[w + 1]``: ``NOT_STARTED`` -> ``CALLED_OFF``,
    atomically; ``claimed`` only: the caller ran until every item was
    taken), else wait up to ``JOIN_POLLS`` polls for its ``finished`` flag
    to reach ``call[0]``."""
    if not (_is_pool_arrays(flags, call) and isinstance(claimed, types.Boolean)):
        return None

    def codegen(context, builder, sig, args):
        flags_at, call_at, sequence, workers, half = _flag_slots(context, builder, sig, args)
        i64 = ir.IntType(64)
        claimed_ = context.cast(builder, args[2], sig.args[2], types.boolean)

        def join(worker, _):
            state = builder.gep(call_at, [builder.add(worker, ir.Constant(i64, 1))])
            with builder.if_then(claimed_):
                builder.cmpxchg(state, ir.Constant(i64, NOT_STARTED), ir.Constant(i64, CALLED_OFF), "acq_rel",
                                "acquire")
            called_off = builder.icmp_signed("==", builder.load_atomic(state, "acquire", align=8),
                                             ir.Constant(i64, CALLED_OFF))
            flag = builder.gep(flags_at, [builder.add(half, builder.mul(worker, ir.Constant(i64, FLAG_SLOT)))])
            with builder.if_then(builder.not_(called_off)):
                before = builder.block
                spin, after = builder.append_basic_block("spin"), builder.append_basic_block("spin.after")
                builder.branch(spin)
                builder.position_at_end(spin)
                polls = builder.phi(i64)
                polls.add_incoming(ir.Constant(i64, 0), before)
                done = builder.or_(builder.icmp_signed(">=", builder.load_atomic(flag, "acquire", align=8), sequence),
                                   builder.icmp_signed(">=", polls, ir.Constant(i64, JOIN_POLLS)))
                waiting = builder.append_basic_block("spin.wait")
                builder.cbranch(done, after, waiting)
                builder.position_at_end(waiting)
                _emit_pause(builder)
                polls.add_incoming(builder.add(polls, ir.Constant(i64, 1)), waiting)
                builder.branch(spin)
                builder.position_at_end(after)
            return []
        _emit_loop(builder, ir.Constant(i64, 0), workers, 1, [], join)
        return context.get_dummy_value()

    return types.void(flags, call, claimed), codegen
