"""The pool's compiled half: resident workers, and how a kernel launches and joins them.

A worker is a Python thread that enters ``resident_loop`` once and stays in
compiled code: between jobs it watches a sequence number (a bounded spin
where jobs come close together, then a futex sleep that one wake releases
for all), and runs each job by the address of its kernel's *entry*.  A
kernel on the pool is ``kernel(first, stop, *args, ctrl, role)`` and
begins with ``if not pool_enter(ctrl, role): return`` and ends with
``pool_exit(ctrl, role)``.  Called from Python (a negative ``role`` that
packs the call: its threads, items, and whether they are claimed and the
GIL let go, ``control.caller_role``), ``pool_enter`` writes the job into
``ctrl``: the kernel's own arguments into its record
(the flattened LLVM arguments of the function being compiled: arrays as
their fields), the address of an *entry* function compiled beside the
kernel (it reads the record back and calls the kernel with a worker's
``first``, ``stop`` and ``role``), and posts the job: one release store
and, only where a worker sleeps, one futex wake.  Launch and join cost the
caller O(1) in the thread count but for the stores of the workers' states;
Python writes nothing into the words the workers watch: a spinning worker
would see each of its stores (with a leaner ``pool.run``, a launch went from
4.26 to 2.58 us).

* Shares: worker ``r`` of ``T`` runs items ``[n r / T, n (r + 1) / T)``, or,
  ``claimed``, every item from a shared counter.  A share's state goes
  ``2 seq`` (posted) -> ``2 seq + 1`` (started, by the worker, atomically)
  or ``CALLED_OFF`` (by the caller once its own share is done): the caller
  runs a share nobody started itself (claimed: drops it, every item is
  taken), so a worker that wakes late costs a call nothing and the caller
  never waits for a thread that has not started.
* The GIL: a kernel holds the caller's GIL (numkv's kernels are compiled
  without ``nogil``): a small call beside a busy Python thread then never
  waits for Python's switch interval to get it back.  A call ``pool.run``
  expects to be long (its role says so) lets go of it (``PyEval_SaveThread``)
  after posting, runs its own share through the entry (so that an
  exception there is a status, not a Python error raised without the
  GIL), joins, and takes it back: the workers never need it at all.
* Errors: an entry returns numba's status; the first failure's status and
  exception info go to ``ctrl[FAIL_STATUS]`` / ``ctrl[FAIL_INFO]``, which
  ``pool.run`` turns into the exception.
"""

import sys

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .._config import jit
from .control import (CALLED_OFF, CLAIMED, CLAIMED_BIT, CLOSE_NS, DONE, ENTRY, FAIL_INFO, FAIL_STATUS, ITEMS_SHIFT,
                      JOINER, LINE, N_ITEMS, RECORD, RECORD_WORDS, RELEASE_BIT, SEQ, SLEEPERS, SPIN_NS, STATE,
                      STATUS_NONE, STATUS_OK, THREAD_BITS, THREADS, WORKERS)

# sha256 of the sources of the modules this one compiles into its kernels
# (every ``numkv`` module it imports, and theirs): numba's disk cache
# notices edits to a kernel's own file only, and
# ``tests/test_kernel_layout.py`` fails, printing the new value, until this
# is updated after a helper changes (updating it makes numba recompile).
HELPERS_SHA256 = "9db0f56af0e0d8d4dba92ae506437e2936276f52cbcad61ba5a91e28f18d47d1"

_I64, _I32, _I8P = ir.IntType(64), ir.IntType(32), ir.IntType(8).as_pointer()
_LINUX = sys.platform.startswith("linux")
_SYS_FUTEX = {"x86_64": 202, "aarch64": 98, "ppc64le": 221, "s390x": 238}
_FUTEX_WAIT, _FUTEX_WAKE = 128, 129  # FUTEX_WAIT_PRIVATE, FUTEX_WAKE_PRIVATE


def _is_ctrl(ctrl):
    return isinstance(ctrl, types.Array) and ctrl.dtype == types.int64 and ctrl.ndim == 1


def _word(builder, data, index):
    """IR: a pointer to ``ctrl[index]`` (``index`` an int or an i64 value)."""
    return builder.gep(data, [index if isinstance(index, ir.Value) else ir.Constant(_I64, index)])


def _const(value):
    return ir.Constant(_I64, value)


# -- the system: futex, clock, pause ----------------------------------------------------


def _syscall(builder, *args):
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_I64, [_I64], var_arg=True), "syscall")
    return builder.call(fn, list(args))


def _futex_number():
    import platform

    return _SYS_FUTEX.get(platform.machine().lower(), 202)


def _emit_futex_wait(builder, at, expected):
    """Sleep while the low 32 bits of ``*at`` equal ``expected``'s (Linux);
    elsewhere ~50 us (``usleep``), and the caller looks again."""
    if _LINUX:
        _syscall(builder, _const(_futex_number()), builder.bitcast(at, _I8P), ir.Constant(_I32, _FUTEX_WAIT),
                 builder.trunc(expected, _I32), ir.Constant(_I8P, None), ir.Constant(_I8P, None), ir.Constant(_I32, 0))
    else:  # pragma: no cover - not Linux
        usleep = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_I32, [_I32]), "usleep")
        builder.call(usleep, [ir.Constant(_I32, 50)])


def _emit_futex_wake(builder, at, count):
    if _LINUX:
        _syscall(builder, _const(_futex_number()), builder.bitcast(at, _I8P), ir.Constant(_I32, _FUTEX_WAKE),
                 ir.Constant(_I32, count))


def _emit_pause(builder):
    import platform

    if platform.machine().lower() in ("x86_64", "amd64", "i386", "i686"):
        pause = builder.module.declare_intrinsic("llvm.x86.sse2.pause", fnty=ir.FunctionType(ir.VoidType(), []))
        builder.call(pause, [])


def _emit_now(builder):
    """IR: CLOCK_MONOTONIC in nanoseconds (``clock_gettime``: the vDSO, ~20 ns)."""
    timespec = ir.LiteralStructType([_I64, _I64])
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_I32, [_I32, timespec.as_pointer()]),
                                        "clock_gettime")
    slot = cgutils.alloca_once(builder, timespec)
    builder.call(fn, [ir.Constant(_I32, 1), slot])
    seconds = builder.load(builder.gep(slot, [ir.Constant(_I32, 0), ir.Constant(_I32, 0)]))
    nanos = builder.load(builder.gep(slot, [ir.Constant(_I32, 0), ir.Constant(_I32, 1)]))
    return builder.add(builder.mul(seconds, _const(1_000_000_000)), nanos)


# -- small intrinsics for the worker loop ------------------------------------------------


def _ctrl_data(context, builder, sig, args):
    return context.make_array(sig.args[0])(context, builder, args[0]).data


@intrinsic
def _load(typingctx, ctrl, index):
    """``ctrl[index]``, sequentially consistent."""
    if not _is_ctrl(ctrl):
        return None

    def codegen(context, builder, sig, args):
        return builder.load_atomic(_word(builder, _ctrl_data(context, builder, sig, args), args[1]), "seq_cst", 8)

    return types.int64(ctrl, types.int64), codegen


@intrinsic
def _store(typingctx, ctrl, index, value):
    """``ctrl[index] = value``, sequentially consistent."""
    if not _is_ctrl(ctrl):
        return None

    def codegen(context, builder, sig, args):
        builder.store_atomic(args[2], _word(builder, _ctrl_data(context, builder, sig, args), args[1]), "seq_cst", 8)
        return context.get_dummy_value()

    return types.void(ctrl, types.int64, types.int64), codegen


@intrinsic
def _add(typingctx, ctrl, index, value):
    """``ctrl[index] += value`` atomically (sequentially consistent)."""
    if not _is_ctrl(ctrl):
        return None

    def codegen(context, builder, sig, args):
        at = _word(builder, _ctrl_data(context, builder, sig, args), args[1])
        builder.atomic_rmw("add", at, args[2], "seq_cst")
        return context.get_dummy_value()

    return types.void(ctrl, types.int64, types.int64), codegen


@intrinsic
def _swap_if(typingctx, ctrl, index, expected, value):
    """Whether ``ctrl[index]`` held ``expected`` and now holds ``value``."""
    if not _is_ctrl(ctrl):
        return None

    def codegen(context, builder, sig, args):
        at = _word(builder, _ctrl_data(context, builder, sig, args), args[1])
        return builder.extract_value(builder.cmpxchg(at, args[2], args[3], "seq_cst", "seq_cst"), 1)

    return types.boolean(ctrl, types.int64, types.int64, types.int64), codegen


@intrinsic
def _futex_wait(typingctx, ctrl, index, expected):
    if not _is_ctrl(ctrl):
        return None

    def codegen(context, builder, sig, args):
        _emit_futex_wait(builder, _word(builder, _ctrl_data(context, builder, sig, args), args[1]), args[2])
        return context.get_dummy_value()

    return types.void(ctrl, types.int64, types.int64), codegen


@intrinsic
def _futex_wake(typingctx, ctrl, index):
    """Wake every thread asleep on ``ctrl[index]``."""
    if not _is_ctrl(ctrl):
        return None

    def codegen(context, builder, sig, args):
        _emit_futex_wake(builder, _word(builder, _ctrl_data(context, builder, sig, args), args[1]), 0x7FFFFFFF)
        return context.get_dummy_value()

    return types.void(ctrl, types.int64), codegen


@intrinsic
def _now(typingctx):
    def codegen(context, builder, sig, args):
        return _emit_now(builder)

    return types.int64(), codegen


@intrinsic
def _pause(typingctx):
    def codegen(context, builder, sig, args):
        _emit_pause(builder)
        return context.get_dummy_value()

    return types.void(), codegen


# -- running a share by its entry -------------------------------------------------------


def _emit_share(builder, data, role):
    """IR: ``(first, stop)`` of share ``role`` of the posted job."""
    n, threads = builder.load(_word(builder, data, N_ITEMS)), builder.load(_word(builder, data, THREADS))
    claimed = builder.icmp_signed("!=", builder.load(_word(builder, data, CLAIMED)), _const(0))
    first = builder.sdiv(builder.mul(n, role), threads)
    stop = builder.sdiv(builder.mul(n, builder.add(role, _const(1))), threads)
    return builder.select(claimed, _const(0), first), builder.select(claimed, n, stop)


def _entry_type():
    return ir.FunctionType(_I32, [_I8P, _I64, _I64, _I64, _I8P.as_pointer()])


def _emit_run_entry(builder, data, entry, first, stop, role):
    """IR: call ``entry`` for one share; a failure's status and exception
    info to ``ctrl[FAIL_*]`` (the first one only)."""
    info = cgutils.alloca_once_value(builder, ir.Constant(_I8P, None))
    record = builder.bitcast(_word(builder, data, RECORD), _I8P)
    status = builder.call(entry, [record, first, stop, role, info])
    status = builder.sext(status, _I64)
    failed = builder.and_(builder.icmp_signed("!=", status, _const(STATUS_OK)),
                          builder.icmp_signed("!=", status, _const(STATUS_NONE)))
    with builder.if_then(failed, likely=False):
        first_failure = builder.extract_value(
            builder.cmpxchg(_word(builder, data, FAIL_STATUS), _const(0), status, "seq_cst", "seq_cst"), 1)
        with builder.if_then(first_failure):
            builder.store_atomic(builder.ptrtoint(builder.load(info), _I64), _word(builder, data, FAIL_INFO),
                                 "seq_cst", 8)


@intrinsic
def _run_share(typingctx, ctrl, role):
    """Run share ``role`` of the posted job through its entry (a worker)."""
    if not _is_ctrl(ctrl):
        return None

    def codegen(context, builder, sig, args):
        data = _ctrl_data(context, builder, sig, args)
        entry = builder.inttoptr(builder.load(_word(builder, data, ENTRY)), _entry_type().as_pointer())
        first, stop = _emit_share(builder, data, args[1])
        _emit_run_entry(builder, data, entry, first, stop, args[1])
        return context.get_dummy_value()

    return types.void(ctrl, types.int64), codegen


# -- the kernel's side ------------------------------------------------------------------


def _kernel_entry(context, builder):
    """The entry of the function being compiled (``builder.function``, a
    numba native function ``i32 (ret*, excinfo**, args...)`` whose first two
    arguments are ``first`` and ``stop`` and whose last is ``role``): it
    loads the arguments from a record laid out as ``_record_type`` and calls
    the function with a share's ``first``, ``stop`` and ``role``."""
    kernel = builder.function
    name = kernel.name + ".numkv_pool_entry"
    module = builder.module
    if name in module.globals:
        return module.get_global(name)
    record_type = _record_type(kernel)
    if context.get_abi_sizeof(record_type) > RECORD_WORDS * 8:
        raise TypeError(f"{kernel.name}: its arguments do not fit the pool's record ({RECORD_WORDS * 8} bytes)")
    entry = ir.Function(module, _entry_type(), name)
    entry.linkage = "internal"
    b = ir.IRBuilder(entry.append_basic_block())
    record = b.bitcast(entry.args[0], record_type.as_pointer())
    values = [b.load(b.gep(record, [ir.Constant(_I32, 0), ir.Constant(_I32, k)]))
              for k in range(len(record_type.elements))]
    values[0], values[1], values[-1] = entry.args[1], entry.args[2], entry.args[3]
    returned = cgutils.alloca_once(b, kernel.args[0].type.pointee)
    info = cgutils.alloca_once_value(b, ir.Constant(kernel.args[1].type.pointee, None))
    status = b.call(kernel, [returned, info, *values])
    b.store(b.bitcast(b.load(info), _I8P), entry.args[4])
    b.ret(status)
    return entry


def _record_type(kernel):
    return ir.LiteralStructType([a.type for a in kernel.args[2:]])


def _emit_join(builder, data, entry, sequence, threads):
    """IR, the caller once its share is done: each other share it takes back
    where nobody started it (and runs, unless the items are claimed: then
    every one is taken), else it waits for the worker's ``done`` to reach
    ``sequence``: spinning, then asleep on it."""
    claimed = builder.icmp_signed("!=", builder.load(_word(builder, data, CLAIMED)), _const(0))
    with cgutils.for_range_slice(builder, _const(1), threads, _const(1), intp=_I64) as (role, _):
        line = builder.add(_const(WORKERS), builder.mul(role, _const(LINE)))
        state = _word(builder, data, builder.add(line, _const(STATE)))
        took = builder.extract_value(builder.cmpxchg(state, builder.mul(sequence, _const(2)), _const(CALLED_OFF),
                                                     "seq_cst", "seq_cst"), 1)
        with builder.if_else(took) as (taken, started):
            with taken:
                with builder.if_then(builder.not_(claimed)):
                    first, stop = _emit_share(builder, data, role)
                    _emit_run_entry(builder, data, entry, first, stop, role)
            with started:
                _emit_wait_done(builder, data, builder.add(line, _const(DONE)), sequence)


JOIN_SPIN_NS = 50_000  # the caller spins this long for a started share, then sleeps


def _emit_wait_done(builder, data, at_index, sequence):
    done_at = _word(builder, data, at_index)
    joiner = _word(builder, data, JOINER)
    start = _emit_now(builder)
    loop, after = builder.append_basic_block("join.loop"), builder.append_basic_block("join.after")
    builder.branch(loop)
    builder.position_at_end(loop)
    done = builder.load_atomic(done_at, "seq_cst", 8)
    with builder.if_then(builder.icmp_signed(">=", done, sequence)):
        builder.branch(after)
    spinning = builder.icmp_signed("<", builder.sub(_emit_now(builder), start), _const(JOIN_SPIN_NS))
    with builder.if_else(spinning) as (spin, sleep):
        with spin:
            _emit_pause(builder)
        with sleep:
            builder.store_atomic(_const(1), joiner, "seq_cst", 8)
            done = builder.load_atomic(done_at, "seq_cst", 8)
            with builder.if_then(builder.icmp_signed("<", done, sequence)):
                _emit_futex_wait(builder, done_at, done)
            builder.store_atomic(_const(0), joiner, "seq_cst", 8)
    builder.branch(loop)
    builder.position_at_end(after)


def _emit_caller_call(builder, role):
    """IR: a caller's ``(threads, n_items, claimed, release)``, unpacked from
    its role (``control.caller_role``; a worker's role, >= 0, gives junk)."""
    code = builder.sub(_const(-1), role)
    threads = builder.add(builder.and_(code, _const((1 << THREAD_BITS) - 1)), _const(1))
    claimed = builder.and_(builder.ashr(code, _const(CLAIMED_BIT)), _const(1))
    release = builder.icmp_signed("!=", builder.and_(builder.ashr(code, _const(RELEASE_BIT)), _const(1)), _const(0))
    return threads, builder.ashr(code, _const(ITEMS_SHIFT)), claimed, release


@intrinsic
def pool_enter(typingctx, ctrl, role):
    """The first statement of a pool kernel (see the module docstring):
    whether this call goes on to run its share ``[first, stop)`` here."""
    if not (_is_ctrl(ctrl) and isinstance(role, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        data = _ctrl_data(context, builder, sig, args)
        role_ = context.cast(builder, args[1], sig.args[1], types.int64)
        go_on = cgutils.alloca_once_value(builder, ir.Constant(ir.IntType(1), 1))
        with builder.if_then(builder.icmp_signed("<", role_, _const(0))):
            kernel = builder.function
            entry = _kernel_entry(context, builder)
            threads, n_items, claimed, release = _emit_caller_call(builder, role_)
            many = builder.icmp_signed(">", threads, _const(1))
            with builder.if_then(builder.or_(many, release)):  # the job, for the workers (or for the entry)
                record = builder.bitcast(_word(builder, data, RECORD), _record_type(kernel).as_pointer())
                for k, value in enumerate(kernel.args[2:]):
                    builder.store(value, builder.gep(record, [ir.Constant(_I32, 0), ir.Constant(_I32, k)]))
                for index, value in ((ENTRY, builder.ptrtoint(entry, _I64)), (THREADS, threads), (N_ITEMS, n_items),
                                     (CLAIMED, claimed)):
                    builder.store(value, _word(builder, data, index))
            sequence = builder.add(builder.load(_word(builder, data, SEQ)), _const(1))
            with builder.if_then(many):
                with cgutils.for_range_slice(builder, _const(1), threads, _const(1), intp=_I64) as (r, _):
                    state = builder.add(_const(WORKERS + STATE), builder.mul(r, _const(LINE)))
                    builder.store(builder.mul(sequence, _const(2)), _word(builder, data, state))
                builder.store_atomic(sequence, _word(builder, data, SEQ), "seq_cst", 8)
                sleepers = builder.load_atomic(_word(builder, data, SLEEPERS), "seq_cst", 8)
                with builder.if_then(builder.icmp_signed(">", sleepers, _const(0)), likely=False):
                    _emit_futex_wake(builder, _word(builder, data, SEQ), 0x7FFFFFFF)
            with builder.if_then(release):
                pyapi = context.get_python_api(builder)
                thread_state = pyapi.save_thread()
                _emit_run_entry(builder, data, entry, kernel.args[2], kernel.args[3], _const(0))
                with builder.if_then(many):
                    _emit_join(builder, data, entry, sequence, threads)
                pyapi.restore_thread(thread_state)
                builder.store(ir.Constant(ir.IntType(1), 0), go_on)
        return builder.load(go_on)

    return types.boolean(ctrl, role), codegen


@intrinsic
def pool_exit(typingctx, ctrl, role):
    """The last statement of a pool kernel: the caller of a call on several
    threads that kept the GIL joins its workers (see the module docstring)."""
    if not (_is_ctrl(ctrl) and isinstance(role, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        data = _ctrl_data(context, builder, sig, args)
        role_ = context.cast(builder, args[1], sig.args[1], types.int64)
        with builder.if_then(builder.icmp_signed("<", role_, _const(0))):
            threads = _emit_caller_call(builder, role_)[0]
            with builder.if_then(builder.icmp_signed(">", threads, _const(1))):
                _emit_join(builder, data, _kernel_entry(context, builder), builder.load(_word(builder, data, SEQ)),
                           threads)
        return context.get_dummy_value()

    return types.void(ctrl, role), codegen


# -- compiled functions -----------------------------------------------------------------


@jit(release_gil=True)
def resident_loop(ctrl, index, last):
    """Worker ``index``'s life: wait for a job newer than ``last``, run its
    share where it is one of the job's threads and nobody took it back,
    say so, and wait again -- spinning (``_pause``) for ``ctrl[SPIN_NS]``
    after a job only where the gap before that job was shorter than
    ``ctrl[CLOSE_NS]``, then asleep on ``ctrl[SEQ]``.  Never returns."""
    line = WORKERS + index * LINE
    close, finished, spin, close_ns = False, _now(), _load(ctrl, SPIN_NS), _load(ctrl, CLOSE_NS)
    while True:
        sequence = _load(ctrl, SEQ)
        while sequence == last:
            if close and _now() - finished < spin:
                _pause()
            else:
                _add(ctrl, SLEEPERS, 1)
                if _load(ctrl, SEQ) == last:
                    _futex_wait(ctrl, SEQ, last)
                _add(ctrl, SLEEPERS, -1)
            sequence = _load(ctrl, SEQ)
        close = _now() - finished < close_ns
        last = sequence
        if index < _load(ctrl, THREADS) and _swap_if(ctrl, line + STATE, 2 * sequence, 2 * sequence + 1):
            _run_share(ctrl, index)
            _store(ctrl, line + DONE, sequence)
            if _load(ctrl, JOINER) != 0:
                _futex_wake(ctrl, line + DONE)
        finished = _now()


def compile_resident_loop(ctrl):
    """``resident_loop``, compiled for ``ctrl`` (before a worker enters it)."""
    from numba import typeof

    resident_loop.compile((typeof(ctrl), types.int64, types.int64))
    return resident_loop


@jit()
def join_after_error(ctrl):
    """After the caller's share raised (it never reached ``pool_exit``), or
    its call raised before the kernel ran (then ``ctrl`` holds the last
    job): take back every share nobody started, wait for those that started
    this job -- never for one taken back (its ``done`` stays behind)."""
    sequence, threads = _load(ctrl, SEQ), _load(ctrl, THREADS)
    for role in range(1, threads):
        line = WORKERS + role * LINE
        if not _swap_if(ctrl, line + STATE, 2 * sequence, CALLED_OFF) \
                and _load(ctrl, line + STATE) == 2 * sequence + 1:
            while _load(ctrl, line + DONE) < sequence:
                _pause()


@jit()
def empty(first, stop, ctrl, role):
    """A kernel that does nothing, on the pool: what a launch costs."""
    if not pool_enter(ctrl, role):
        return
    pool_exit(ctrl, role)
