"""Backward of packed causal GQA attention on torch's FlashAttention-2 kernel (a docs/design.md rule 8 candidate).

Why: speed. The backward needs no invariance (docs/design.md rule 8), only correctness, so it
may be any correct kernel. On the H200 our Triton backward (`attention_backward.py`) runs at
119-162 TFLOP/s where torch's FlashAttention-2 backward runs at 208-294. This module feeds *our*
forward's ``out`` and log-sum-exp to torch's kernel (``aten::_flash_attention_backward``, varlen
form); the forward stays ours, since it must equal the paged decode bitwise (rule 2).

What it requires (`flash_backward_unavailable_reason` checks each, in this order): the op in
this torch build; q, k, v of one dtype, float16 or bfloat16; one head dim for q, k and v (FA2
has no separate value head dim, so the latent MLA layout, V a narrower view of K, never
qualifies and keeps its own backward), a multiple of 8 and at most 256; CUDA tensors on an
SM80+ GPU with torch built with FlashAttention; not ROCm (its AOTriton varlen kernel wants
another LSE layout). K and V may have fewer heads than Q (GQA): the op reads ``num_heads_k``
from K, computes per-query-head dK/dV and sums each group (in q's dtype, where our Triton kernel
sums the group in fp32), which also costs transient memory: two ``[T, Hq, D]`` buffers in q's
dtype and an fp32 dQ accumulator of ``[T + 128 S, Hq, D]``.

The LSE conversion. Our forward stores ``lse_log2[T, Hq]``, fp32, the log2-sum-exp2 of the
scaled scores, log2(sum_j 2^(s_j * scale * log2(e))) = ln(sum_j e^(s_j * scale)) / ln(2). The
varlen FA2 backward reads the *natural-log* LSE in the unpadded layout ``[Hq, T]``, fp32,
contiguous (row ``h * total_q + token``; it checks neither the shape nor the strides) and
recomputes ``P = exp2(s * scale * log2(e) - lse * log2(e))`` (``scale_apply_exp2</*scale_max=*/
false>``). So we pass ``(lse_log2 * ln 2)`` transposed to ``[Hq, T]``, written contiguous by one
kernel; the round trip through ln 2 and log2(e) costs about one ulp of the LSE, far below bf16.

The op's schema since pytorch commit 3ecfe6be (2025-02-25, torch 2.7), so in torch 2.11 (the
GPU's) and 2.13 (local, checked by the tests):
``_flash_attention_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k,
max_q, max_k, dropout_p, is_causal, rng_state, unused, *, scale=None, window_size_left=None,
window_size_right=None) -> (dq, dk, dv)``; before it the two tensors after ``is_causal`` were
named ``philox_seed``/``philox_offset`` (we pass them positionally). With ``dropout_p = 0``
the kernel never reads them; we pass what torch's own ``nn.attention.varlen`` passes: a ``[2]``
uint64 tensor and an empty one. ``grad_out`` and ``out`` are made contiguous inside the op;
q/k/v need only a unit last stride; ``cum_seq_*`` must be int32 and contiguous. Causal masking
in FA2 varlen is aligned to the bottom right, which is our top-left causal mask because every
sequence has as many keys as queries.

Run to run: FA2 accumulates dQ with atomics, so dQ (not dK/dV) may differ in its last bits
between two identical steps, where our Triton backward repeats bitwise; under
``torch.use_deterministic_algorithms(True)`` torch runs FA2's deterministic dQ variant (not with
``warn_only=True``, where torch only warns and keeps the atomics).

Selecting it: `attention_backward_choice.py` (``VEXACT_ATTENTION_BACKWARD``; under ``auto`` it
runs where neither cuDNN's nor FlashAttention-4's backward applies, before our Triton backward).
"""

from __future__ import annotations

import functools
import math

import torch


FLASH_DTYPES = (torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256  # the largest head dim FA2's backward compiles
HEAD_DIM_MULTIPLE = 8
MIN_CAPABILITY = (8, 0)
LN2 = math.log(2.0)


def _flash_op():
    return getattr(torch.ops.aten, "_flash_attention_backward", None)


def flash_backward_unavailable_reason(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
    """Why torch's FlashAttention-2 backward cannot serve packed attention over q ``[T, Hq, D]``,
    k ``[T, Hkv, D]``, v ``[T, Hkv, Dv]``, or None when it can. Checked in a fixed order (op,
    dtype, head dims, device, build), so the first failing requirement is named."""
    if _flash_op() is None:
        return f"torch {torch.__version__} has no aten::_flash_attention_backward"
    if q.dtype not in FLASH_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"dtypes q={q.dtype}, k={k.dtype}, v={v.dtype}: FlashAttention needs all of one of {FLASH_DTYPES}"
    d, dk, dv = q.shape[-1], k.shape[-1], v.shape[-1]
    if not d == dk == dv:
        return f"head dims q={d}, k={dk}, v={dv}: FlashAttention-2 needs one head dim for q, k and v"
    if d % HEAD_DIM_MULTIPLE or d > MAX_HEAD_DIM:
        return f"head dim {d}: FlashAttention-2's backward needs a multiple of {HEAD_DIM_MULTIPLE} <= {MAX_HEAD_DIM}"
    if q.device.type != "cuda" or k.device != q.device or v.device != q.device:
        return f"devices q={q.device}, k={k.device}, v={v.device}: the flash backward needs CUDA tensors on one GPU"
    return _gpu_unavailable_reason(q.device)


@functools.lru_cache(maxsize=None)
def _gpu_unavailable_reason(device: torch.device) -> str | None:
    """The requirements that depend on the GPU and the torch build only: asked once per device
    (every layer's backward checks availability)."""
    if torch.version.hip is not None:
        return "ROCm: its varlen flash backward expects another LSE layout"
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        return f"GPU capability {capability}: FlashAttention-2 needs {MIN_CAPABILITY} or newer"
    built = getattr(torch.backends.cuda, "is_flash_attention_available", lambda: True)()
    if not built:
        return "this torch build has no FlashAttention kernels"
    return None


def flash_backward_available(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """True when `attention_backward_flash` can compute the gradients of packed attention over
    these q, k, v (see `flash_backward_unavailable_reason` for what it needs)."""
    return flash_backward_unavailable_reason(q, k, v) is None


def _check_inputs(grad_out, q, k, v, out, lse_log2, cu_seqlens, max_seqlen) -> None:
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"attention_backward_flash: q, k, v must be [tokens, heads, head_dim], got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    n_tokens, n_heads, _ = q.shape
    if k.shape[0] != n_tokens or v.shape[0] != n_tokens or n_heads % k.shape[1]:
        raise ValueError(f"attention_backward_flash: k {tuple(k.shape)} / v {tuple(v.shape)} do not pack with "
                         f"q {tuple(q.shape)} (same tokens, query heads a multiple of KV heads)")
    for name, t in (("grad_out", grad_out), ("out", out)):
        if t.shape != q.shape or t.dtype != q.dtype:
            raise ValueError(f"attention_backward_flash: {name} is {tuple(t.shape)} {t.dtype}, "
                             f"must be q's {tuple(q.shape)} {q.dtype}")
    # the kernel reads the LSE through a raw pointer: a wrong shape would be read silently
    if lse_log2.shape != (n_tokens, n_heads) or lse_log2.dtype != torch.float32:
        raise ValueError(f"attention_backward_flash: lse_log2 is {tuple(lse_log2.shape)} {lse_log2.dtype}, "
                         f"must be [{n_tokens}, {n_heads}] float32 (the forward's log2-sum-exp2)")
    reason = flash_backward_unavailable_reason(q, k, v)
    if reason is not None:
        raise ValueError(f"attention_backward_flash: {reason}")
    if n_tokens == 0:  # nothing to launch: an empty batch may have no sequences
        return
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 2:
        raise ValueError(f"attention_backward_flash: cu_seqlens must be [S+1] with S >= 1, got {tuple(cu_seqlens.shape)}")
    if max_seqlen < 1:
        raise ValueError(f"attention_backward_flash: max_seqlen must be >= 1, got {max_seqlen}")


def attention_backward_flash(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             out: torch.Tensor, lse_log2: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
                             scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq, dk, dv) of packed causal GQA attention by torch's FlashAttention-2 backward.

    Args:
        grad_out: ``[T, Hq, D]`` gradient of the attention output, q's dtype.
        q, k, v: ``[T, Hq, D]``, ``[T, Hkv, D]``, ``[T, Hkv, D]`` of the forward (fp16/bf16, CUDA).
        out: ``[T, Hq, D]`` the forward's output (ours).
        lse_log2: ``[T, Hq]`` fp32, the forward's log2-sum-exp2 of the scaled scores (ours).
        cu_seqlens: ``[S+1]`` sequence offsets; max_seqlen: an upper bound on the sequence lengths.
        scale: the softmax scale the forward used.

    Raises ValueError (naming the argument and the requirement) for inputs the kernel cannot take,
    before launching anything.
    """
    _check_inputs(grad_out, q, k, v, out, lse_log2, cu_seqlens, max_seqlen)
    if q.shape[0] == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    cu = cu_seqlens.to(device=q.device, dtype=torch.int32).contiguous()
    return flash_attention_backward_op(grad_out, q, k, v, out, natural_lse(lse_log2), cu, max_seqlen, scale)


def natural_lse(lse_log2: torch.Tensor) -> torch.Tensor:
    """Our forward's ``[T, Hq]`` log2-sum-exp2 as FA2's varlen LSE: natural log (times ln 2),
    ``[Hq, T]`` fp32 contiguous, written by one kernel."""
    lse = torch.empty((lse_log2.shape[1], lse_log2.shape[0]), device=lse_log2.device, dtype=torch.float32)
    return torch.mul(lse_log2.t(), LN2, out=lse)


def flash_attention_backward_op(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                out: torch.Tensor, lse: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
                                scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The bare ``aten::_flash_attention_backward`` call (varlen, causal, no dropout), without
    checks: `lse` is already `natural_lse`'s ``[Hq, T]``, `cu_seqlens` int32. Use
    `attention_backward_flash`."""
    rng_state = torch.empty(2, device=q.device, dtype=torch.uint64)  # unread at dropout 0
    unused = torch.empty(0, device=q.device)
    dq, dk, dv = _flash_op()(grad_out, q, k, v, out, lse, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, 0.0, True,
                             rng_state, unused, scale=scale)
    return dq, dk, dv
