"""``cblas_?gemm`` called from compiled loops, by the address ``_cblas`` finds: each
call a Numba intrinsic, with no Python between the calls and no GIL held; and an
address as a typed pointer, for the rows a loop reads itself
(``pip install portattn-numpy[jit]``; importing this module without Numba raises
``ImportError``)."""

from __future__ import annotations

from typing import Any

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

__all__ = ["NO_TRANS", "ROW_MAJOR", "TRANS", "gemm", "pointer"]

#: CBLAS's ``CblasRowMajor``, ``CblasNoTrans`` and ``CblasTrans``.
ROW_MAJOR, NO_TRANS, TRANS = 101, 111, 112


@intrinsic
def gemm(typingctx: Any, address: Any, trans_a: Any, trans_b: Any, m: Any, n: Any,
         k: Any, alpha: Any, a: Any, lda: Any, b: Any, ldb: Any, beta: Any, c: Any,
         ldc: Any) -> Any:
    """``cblas_?gemm`` (row-major, 64-bit integers) at ``address``; ``a``, ``b`` and
    ``c`` are addresses, ``alpha`` and ``beta`` of the matrices' float type."""
    real = alpha

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        enum, integer, pointer = ir.IntType(32), ir.IntType(64), ir.IntType(8).as_pointer()
        scalar = context.get_value_type(real)
        function = ir.FunctionType(ir.VoidType(), [
            enum, enum, enum, integer, integer, integer, scalar, pointer, integer, pointer,
            integer, scalar, pointer, integer])
        (address_, trans_a_, trans_b_, m_, n_, k_, alpha_, a_, lda_, b_, ldb_, beta_, c_,
         ldc_) = args
        callee = builder.inttoptr(address_, function.as_pointer())
        builder.call(callee, [
            ir.Constant(enum, ROW_MAJOR), builder.trunc(trans_a_, enum),
            builder.trunc(trans_b_, enum), m_, n_, k_, alpha_,
            builder.inttoptr(a_, pointer), lda_, builder.inttoptr(b_, pointer), ldb_, beta_,
            builder.inttoptr(c_, pointer), ldc_])
        return context.get_dummy_value()

    int64 = types.int64
    return types.void(int64, int64, int64, int64, int64, int64, real, int64, int64, int64,
                      int64, real, int64, int64), codegen


@intrinsic
def pointer(typingctx: Any, address: Any, like: Any) -> Any:
    """``address`` as a pointer to the type of ``like`` (a float), for
    ``numba.carray``: rows a compiled loop reads where ``?gemm``'s callers would."""
    typed = types.CPointer(like)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.inttoptr(args[0], context.get_value_type(typed))

    return typed(types.int64, like), codegen
