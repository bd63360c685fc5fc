"""Triton's interpreter with products whose rows do not depend on each other, as a GPU's are.

With ``TRITON_INTERPRET=1`` Triton runs kernels on the CPU through numpy, and
``GENLM_EXACT_FUSED=1`` sends exact attention there
(:func:`genlm_backend.llm.hf.exact.uses_fused_kernels`). A GPU's matrix
instructions sum each output element over the same operands in the same
order whichever row it is in; numpy's BLAS does not (a row's bits change
with its place in the product). :func:`row_independent_products` makes the
interpreter's ``tl.dot`` compute each row by itself, one vector-matrix
product per row, so that the kernels' fixed order can be tested here; on a
GPU the same tests run on the hardware's products.
"""

from __future__ import annotations

import os


def interpreted() -> bool:
    """Whether exact attention runs Triton's interpreter in this process."""
    return os.environ.get("TRITON_INTERPRET") == "1" and os.environ.get("GENLM_EXACT_FUSED") == "1"


def row_independent_products() -> None:
    """Replace the interpreter's ``tl.dot`` by one that computes each row alone."""
    import numpy as np
    from triton.runtime import interpreter

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        dtype = d.data.dtype
        rows = np.stack([np.matmul(row, b.data, dtype=dtype) for row in a.data])
        return interpreter.TensorHandle(rows + d.data, d.dtype.scalar)

    interpreter.InterpreterBuilder.create_dot = create_dot
