"""Shared by every Triton check: under TRITON_INTERPRET=1, `tl.dot` as the checks need it.

triton 3.6's interpreter computes ``tl.dot`` with numpy's matmul: it multiplies bf16's raw bit
patterns (it keeps bf16 as uint16), and BLAS rounds an output element differently for different
tile shapes (an AMD EPYC's OpenBLAS changed fp32 rows when only the tile's N changed), which the
checks that compare launch configurations bitwise cannot tell from a kernel bug. The dot below
widens bf16 to fp32 and accumulates each output element over k in order, one rounded product and
one rounded sum per step: the element's arithmetic depends on its own row and column alone, as
rule 1 asks of the GPU kernels. The GPU compiler is not affected; on a GPU nothing is patched.
"""

import os


def _patch_interpreter_dot() -> None:
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder.create_dot, "_in_k_order", False):
        return

    def operand(x, acc_dtype):
        data = x.data
        if x.dtype.scalar == tl.bfloat16:
            data = interpreter._convert_float(data, tl.bfloat16, tl.float32, None).view(np.float32)
        return data.astype(acc_dtype, copy=False)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        acc = d.data.dtype
        a_data, b_data = operand(a, acc), operand(b, acc)
        out = np.zeros(a_data.shape[:-1] + b_data.shape[-1:], dtype=acc)
        for k in range(a_data.shape[-1]):
            out += a_data[..., :, k:k + 1] * b_data[..., k:k + 1, :]
        return interpreter.TensorHandle(out + d.data, d.dtype.scalar)

    create_dot._in_k_order = True
    builder.create_dot = create_dot


if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_interpreter_dot()
