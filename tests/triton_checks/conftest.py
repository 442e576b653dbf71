"""Shared by every Triton check: under TRITON_INTERPRET=1, `tl.dot` and bf16 rounding as the GPU's.

triton 3.6's interpreter computes ``tl.dot`` with numpy's matmul: it multiplies bf16's raw bit
patterns (it keeps bf16 as uint16), and BLAS rounds an output element differently for different
tile shapes (an AMD EPYC's OpenBLAS changed fp32 rows when only the tile's N changed), which the
checks that compare launch configurations bitwise cannot tell from a kernel bug. The dot below
widens bf16 to fp32 and, like Hopper's MMA, adds to the accumulator once per 16 values of k:
each step's products are summed in k order (one rounded product and one rounded sum each) and
that sum is added to the accumulator. An element's arithmetic then depends on its own row and
column alone, as rule 1 asks of the GPU kernels, and not on how wide a K tile is (the GPU's
chain of 16-wide MMA steps gives a 128-wide tile the bits of two 64-wide ones; the MoE decode
tiles rely on it).

And fp32 -> bf16 conversions as the GPU makes them: triton 3.6's interpreter truncates them (its
``cast_impl`` drops the low 16 bits; its "rtne" `fp_to_fp` adds the cut-off bit, rounding ties
away from zero and mishandling a carry into the exponent), where the GPU's ``cvt.rn.bf16.f32`` rounds to nearest
even, as torch does. Below, both round through torch's conversion (toward zero only where a
kernel asks ``rtz``), so a check compares a kernel's bf16 results with torch's bits on CPU as on
the GPU. The GPU compiler is not affected; on a GPU nothing is patched.

And a scalar broadcast to a block keeps the block's element type: triton 3.9's interpreter types a
comparison's scalar result by its operands (``n > 0`` of an int32 ``n`` is an int32 handle
holding a bool), and its ``create_splat`` takes that type, so ``(n > 0) & (cols < N)`` became an
int32 mask that its loads refuse ("mask has unsupported dtype"). Below the splat takes the type
the block was declared with, as the compiler does.

And one speed-up that changes no result: the interpreter patches `triton.language` again at every
call of a ``@triton.jit`` helper from inside a kernel (``inspect.getmembers`` over three modules,
about a fifth of these checks' time), while the launch around it has patched the same modules
already. Below, a helper's call skips that when the running launch's patch covers the language
modules the helper's globals hold (the launch restores them at its end as before). And another:
the interpreter reduces with a combine function of its own one element at a time in Python, as
``tl.xor_sum`` and ``tl.reduce_or`` do (``tl.topk`` and ``tl.sort`` are made of ``xor_sum``: a
2048-slot ``tl.topk`` took 30 s of `kernels.top_tokens`' check); those two run as numpy's
``bitwise_xor`` / ``bitwise_or`` reductions, exact in any order
(check_interpreter.py's ``test_interpreter_bitwise_reductions_are_exact``).
"""

import os

MMA_K = 16  # k values per MMA step: the accumulator is updated once per step


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
        out = d.data.astype(acc, copy=True)
        depth = a_data.shape[-1]
        for start in range(0, depth, MMA_K):
            step = np.zeros_like(out)
            for k in range(start, min(start + MMA_K, depth)):
                step += a_data[..., :, k:k + 1] * b_data[..., k:k + 1, :]
            out += step
        return interpreter.TensorHandle(out, d.dtype.scalar)

    create_dot._in_k_order = True
    builder.create_dot = create_dot


def _patch_interpreter_bf16_rounding() -> None:
    import numpy as np
    import torch
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder.cast_impl, "_to_nearest_even", False):
        return
    cast, fp_to_fp = builder.cast_impl, builder.create_fp_to_fp

    def fp32_to_bf16(src, dst_type) -> bool:
        return src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16

    def nearest_even(src, dst_type):
        wide = torch.from_numpy(src.data.astype(np.float32, copy=True))  # 0-d stays 0-d
        return interpreter.TensorHandle(wide.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16),
                                        dst_type.scalar)

    def cast_impl(self, src, dst_type):
        return nearest_even(src, dst_type) if fp32_to_bf16(src, dst_type) else cast(self, src, dst_type)

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        if fp32_to_bf16(src, dst_type) and rounding_mode != interpreter._ir.ROUNDING_MODE.RTZ:
            return nearest_even(src, dst_type)
        return fp_to_fp(self, src, dst_type, rounding_mode)

    cast_impl._to_nearest_even = True
    builder.cast_impl = cast_impl
    builder.create_fp_to_fp = create_fp_to_fp


def _patch_interpreter_splat() -> None:
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder.create_splat, "_block_type", False):
        return

    def create_splat(self, ret_ty, arg):
        value = arg.data[0] if isinstance(arg.dtype, tl.block_type) else arg.data
        element = ret_ty.scalar
        return interpreter.TensorHandle(np.full(ret_ty.shape, value, dtype=interpreter._get_np_dtype(element)), element)

    create_splat._block_type = True
    builder.create_splat = create_splat


def _patch_interpreter_helper_calls() -> None:
    import functools
    import inspect

    import triton.language as tl
    from triton.runtime import interpreter

    patch_lang, scope_type = getattr(interpreter, "_patch_lang", None), getattr(interpreter, "_LangPatchScope", None)
    executor = getattr(interpreter, "GridExecutor", None)
    if None in (patch_lang, scope_type, executor) or getattr(patch_lang, "_once_per_launch", False):
        return  # (another Triton release: its own patching, unchanged)
    launch = {"patched": None, "starting": False}  # the language modules the running launch patched

    @functools.lru_cache(maxsize=None)
    def languages(fn) -> frozenset:
        return frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))

    def once_per_launch(fn):
        if launch["patched"] is not None and languages(fn) <= launch["patched"]:
            return scope_type()  # (a helper inside a launch that patched its modules: nothing to add)
        scope = patch_lang(fn)
        if launch["starting"]:  # (the launch's own patch, restored at its end)
            launch["patched"], launch["starting"] = languages(fn), False
        elif launch["patched"] is not None:  # (a helper's patch is never restored: it holds to the launch's end)
            launch["patched"] = launch["patched"] | languages(fn)
        return scope

    run = executor.__call__

    @functools.wraps(run)
    def launch_once(self, *args, **kwargs):
        launch["patched"], launch["starting"] = None, True
        try:
            return run(self, *args, **kwargs)
        finally:
            launch["patched"], launch["starting"] = None, False

    once_per_launch._once_per_launch = True
    interpreter._patch_lang = once_per_launch
    executor.__call__ = launch_once


def _patch_interpreter_bitwise_reductions() -> None:
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    ops = getattr(interpreter, "ReduceOps", None)
    ufuncs = {getattr(tl.standard, name, None): ufunc
              for name, ufunc in (("_xor_combine", np.bitwise_xor), ("_or_combine", np.bitwise_or))}
    ufuncs.pop(None, None)
    if ops is None or not ufuncs or getattr(ops.apply_impl, "_bitwise", False):
        return  # (another Triton release: its own reductions, unchanged)
    generic = ops.apply_impl

    def apply_impl(self, input):
        ufunc = ufuncs.get(self.combine_fn)
        if ufunc is None or len(input) != 1:
            return generic(self, input)
        out = ufunc.reduce(input[0].handle.data, axis=self.axis, keepdims=self.keep_dims)
        return self.to_tensor(out, input[0].dtype)

    apply_impl._bitwise = True
    ops.apply_impl = apply_impl


if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_interpreter_helper_calls()
    _patch_interpreter_bitwise_reductions()
    _patch_interpreter_dot()
    _patch_interpreter_bf16_rounding()
    _patch_interpreter_splat()
