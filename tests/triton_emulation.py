"""Triton's interpreter with products whose rows do not depend on each other, as a GPU's are.

With ``TRITON_INTERPRET=1`` Triton runs kernels on the CPU through numpy, and
``GENLM_EXACT_FUSED=1`` sends exact attention there
(:func:`genlm_backend.llm.hf.exact.uses_fused_kernels`). A GPU's matrix
instructions sum each output element over the same operands in the same
order whichever row it is in; numpy's BLAS does not (a row's bits change
with its place in the product). :func:`row_independent_products` makes the
interpreter's ``tl.dot`` compute each row by itself, one vector-matrix
product per row, so that the kernels' fixed order can be tested here; on a
GPU the same tests run on the hardware's products. Under the interpreter
alone, :func:`bfloat16_products` makes its bfloat16 products right.
"""

from __future__ import annotations

import os


def interpreted() -> bool:
    """Whether exact attention runs Triton's interpreter in this process."""
    return os.environ.get("TRITON_INTERPRET") == "1" and os.environ.get("GENLM_EXACT_FUSED") == "1"


def row_independent_products() -> None:
    """Replace the interpreter's ``tl.dot`` by one that computes each row alone (and reads
    bfloat16 operands as :func:`bfloat16_products` does)."""
    _replace_products(row_independent=True)


def bfloat16_products() -> None:
    """Replace the interpreter's ``tl.dot`` by one that reads bfloat16 operands as their values.

    The interpreter holds bfloat16 as its bit patterns (``uint16``) and its
    ``tl.dot`` multiplies those (triton-lang/triton#11584: bfloat16 is not
    supported by the interpreter); a GPU multiplies the values exactly and
    sums in float32, as the replacement does.
    """
    _replace_products(row_independent=False)


def _replace_products(row_independent: bool) -> None:
    import numpy as np
    from triton.runtime import interpreter

    def values(handle):
        if handle.dtype.scalar.is_bf16():  # the bits of a bfloat16 are a float32's upper half
            return (handle.data.astype(np.uint32) << 16).view(np.float32)
        return handle.data

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        left, right, dtype = values(a), values(b), d.data.dtype
        if row_independent:
            product = np.stack([np.matmul(row, right, dtype=dtype) for row in left])
        else:
            product = np.matmul(left, right, dtype=dtype)
        return interpreter.TensorHandle(product + d.data, d.dtype.scalar)

    interpreter.InterpreterBuilder.create_dot = create_dot
