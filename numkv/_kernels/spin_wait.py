"""Spin-waiting for numkv's thread pool: a short wait on a flag, without the GIL.

Waking a sleeping thread costs ~50 us on a virtual machine (measured: an
empty job handed to a pool worker came back in 115 us when the caller slept
until it was done, 27 us when the caller spun), so a caller that expects its
workers to finish soon spins first, with the CPU's pause hint, then sleeps.
"""

import platform

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from .._config import jit


@intrinsic
def _load_acquire(typingctx, flags, index):
    """``flags[index]`` read with acquire ordering: never hoisted out of a loop,
    and what the writer wrote before it is visible after it."""
    def codegen(context, builder, sig, args):
        ary = context.make_array(sig.args[0])(context, builder, args[0])
        return builder.load_atomic(builder.gep(ary.data, [args[1]]), "acquire", align=8)

    return flags.dtype(flags, index), codegen


@intrinsic
def _pause(typingctx):
    """The x86 ``pause`` hint of a spin loop (spares the sibling hyperthread);
    nothing elsewhere."""
    def codegen(context, builder, sig, args):
        if platform.machine().lower() in ("x86_64", "amd64", "i386", "i686"):
            pause = builder.module.declare_intrinsic("llvm.x86.sse2.pause",
                                                     fnty=ir.FunctionType(ir.VoidType(), []))
            builder.call(pause, [])
        return context.get_dummy_value()

    return types.void(), codegen


@jit()
def wait_at_least(flags, index, value, spins):
    """Whether ``flags[index] >= value`` within ``spins`` polls (~30 ns each)."""
    for _ in range(spins):
        if _load_acquire(flags, index) >= value:
            return True
        _pause()
    return False
