"""Backward of `fused_moe` (correct and fast; no invariance needed, docs/design.md rule 8).

With ``y_p`` the down-projection output of pair p = (t, r) and ``w = topk_weights``:
``dy_p = w[t, r] * dout[t]``, ``dw[t, r] = <dout[t], y_p>``; ``d_act = dy @ down[e]``; SiLU-and-mul
backward gives ``d_gate_up``; ``dx_p = d_gate_up_p @ gate_up[e]`` summed over the token's ranks.
The input gradients reuse the grouped GEMM with transposed weight strides; the weight
gradients ``d_down[e] = sum_p dy_p^T act_p`` and ``d_gate_up[e] = sum_p d_gate_up_p^T x_t`` come
from `_moe_weight_grad_kernel`, one program per (expert, N tile, K tile) reducing over that
expert's rows. For bf16 on Hopper all four expert GEMMs run torch's grouped GEMM instead (CUTLASS,
`expert_gemms`, ``VEXACT_MOE_BACKWARD``): with many experts and few rows each, the weight
gradients' reductions are short and our 64-wide tiles were the slower side. The adapters' parts
stay on ours. The reference is autograd through `moe_math`, the plain-torch MoE (also the
tests' oracle of the forward).
"""

from __future__ import annotations

from contextlib import AbstractContextManager

import torch

from ._triton import tl, triton
from .kernel_switch import KernelSwitch
from .moe_activation import PLAIN, ExpertForm, expert_activation_backward, expert_activation_math
from .moe_align import MoeLayout
from .moe_grouped_gemm import combine, grouped_gemm, input_precision
from .moe_lora import ExpertLora, expert_lora_math

WG_BLOCK_N = 64
WG_BLOCK_K = 64
ENV_VAR = "VEXACT_MOE_BACKWARD"
_switch = KernelSwitch(ENV_VAR, ("auto", "triton", "grouped_mm"), "auto", "MoE backward expert GEMMs")


def expert_gemms(*operands: torch.Tensor) -> str:
    """Which kernels the backward's expert GEMMs run on these operands (x, the expert weights):
    ``"grouped_mm"``, torch's grouped GEMM (CUTLASS on Hopper, as stock transformers' experts run),
    for bf16 operands on CUDA; ``"triton"``, our grouped GEMM and `_moe_weight_grad_kernel`. The
    switch ``VEXACT_MOE_BACKWARD`` (``auto``: grouped_mm where it applies, on a GPU of compute
    capability 9 or newer) decides, read at every backward; a forced grouped_mm that cannot run
    raises."""
    mode = _switch.mode()
    fits = all(t.dtype == torch.bfloat16 for t in operands) and hasattr(torch, "_grouped_mm")
    if mode == "grouped_mm" and not fits:
        raise ValueError(f"{ENV_VAR}=grouped_mm needs bf16 operands and torch._grouped_mm; got "
                         f"{sorted({str(t.dtype) for t in operands})} on torch {torch.__version__}")
    if mode == "auto":
        device = operands[0].device
        fits = fits and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9
    return "grouped_mm" if mode == "grouped_mm" or mode == "auto" and fits else "triton"


def use_moe_backward(mode: str | None) -> AbstractContextManager[None]:
    """Within the block, the MoE backward's expert GEMMs are `mode` (``"auto"``, ``"triton"`` or
    ``"grouped_mm"``); None hands the choice back to the environment."""
    return _switch.use(mode)


@triton.jit
def _moe_weight_grad_kernel(g_ptr, a_ptr, dw_ptr, offsets_ptr, sorted_pairs_ptr, num_pairs, N, K,
                            stride_g, stride_a, stride_dwe, stride_dwn,
                            GATHER: tl.constexpr, TOP_K: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                            INPUT_PRECISION: tl.constexpr):
    expert = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.program_id(2) * BLOCK_K + tl.arange(0, BLOCK_K)
    start = tl.load(offsets_ptr + expert)
    end = tl.load(offsets_ptr + expert + 1)
    acc = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
    for row0 in range(start, end, BLOCK_M):
        rows = (row0 + tl.arange(0, BLOCK_M)).to(tl.int64)
        g = tl.load(g_ptr + rows[:, None] * stride_g + offs_n[None, :], mask=offs_n[None, :] < N, other=0.0)
        if GATHER:  # rows of x, through the pair -> token map; padding rows are zero
            pairs = tl.load(sorted_pairs_ptr + rows)
            a_rows = (pairs // TOP_K).to(tl.int64)
            a_mask = (pairs < num_pairs)[:, None] & (offs_k[None, :] < K)
        else:
            a_rows = rows
            a_mask = offs_k[None, :] < K
        a = tl.load(a_ptr + a_rows[:, None] * stride_a + offs_k[None, :], mask=a_mask, other=0.0)
        acc = tl.dot(tl.trans(g), a, acc, input_precision=INPUT_PRECISION)
    mask = (offs_n[:, None] < N) & (offs_k[None, :] < K)
    tl.store(dw_ptr + expert * stride_dwe + offs_n[:, None] * stride_dwn + offs_k[None, :],
             acc.to(dw_ptr.dtype.element_ty), mask=mask)


def _weight_grad(g: torch.Tensor, a: torch.Tensor, layout: MoeLayout, experts: int, gather: bool, top_k: int,
                 out: torch.Tensor) -> torch.Tensor:
    n, k = g.shape[1], a.shape[1]
    grid = (experts, triton.cdiv(n, WG_BLOCK_N), triton.cdiv(k, WG_BLOCK_K))
    _moe_weight_grad_kernel[grid](g, a, out, layout.expert_offsets, layout.sorted_pairs, layout.num_pairs, n, k,
                                  g.stride(0), a.stride(0), out.stride(0), out.stride(1), GATHER=gather,
                                  TOP_K=top_k, BLOCK_M=layout.config.block_m, BLOCK_N=WG_BLOCK_N, BLOCK_K=WG_BLOCK_K,
                                  INPUT_PRECISION=input_precision(g.dtype), num_warps=4, num_stages=2, enable_fp_fusion=True)
    return out


def _cutlass_rows(g: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``g_p w[e]`` for every row p of expert e's padded segment (`offsets`: the segments' ends), by
    torch's grouped GEMM, in g's dtype: its readers widen it as they read (the rows past the last
    segment are left unset: no pair reads them)."""
    return torch._grouped_mm(g, w, offs=offsets)


def _cutlass_weight_grad(g: torch.Tensor, a: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``sum_p g_p^T a_p`` over each expert's padded segment, by torch's grouped GEMM: ``[E, N, K]``
    in g's dtype (padding rows add nothing: their g is zero)."""
    return torch._grouped_mm(g.t(), a, offs=offsets)


def _token_rows(x: torch.Tensor, layout: MoeLayout, top_k: int) -> torch.Tensor:
    """x's row of each padded position's token, zero at padding."""
    pairs = layout.sorted_pairs
    return torch.where((pairs < layout.num_pairs)[:, None], x[(pairs // top_k).clamp(max=x.shape[0] - 1)], 0)


def _lora_backward(g: torch.Tensor, inp: torch.Tensor, d_inp: torch.Tensor, lora: ExpertLora, u: torch.Tensor,
                   layout: MoeLayout, experts: int, top_k: int, gather: bool):
    """One expert adapter's part of the backward (rule 8): ``du = s * g B_e`` and ``d_inp += du A_e``
    by the grouped GEMM, ``dB_e = s * sum g^T u`` and ``dA_e = sum du^T inp`` by the weight-gradient
    kernel, operands in g's dtype. `g` ``[P, N]`` is the adapted GEMM's output gradient over the
    sorted rows, `inp` its input (tokens when `gather`), `u` the forward's shrink. Returns
    (d_inp, (dA, dB)) with dA and dB in PEFT's layouts and the adapter's dtypes."""
    n, k = g.shape[1], inp.shape[1]
    rank, cfg = lora.rank(experts), layout.config
    b = lora.b.to(g.dtype)  # element (rank j, n) of expert e at e + j * E + n * [r * E]
    b_view = b.as_strided((experts, rank, n), (b.stride(1), experts * b.stride(1), b.stride(0)))
    du = grouped_gemm(g, b_view, layout, rank, n, experts * b.stride(1), b.stride(0), torch.float32, cfg)
    du *= lora.scaling
    du_in = du.to(g.dtype)
    a = lora.a.to(g.dtype).view(experts, rank, k)  # element (k, j) of expert e: A[e * r + j, k]
    d_inp += grouped_gemm(du_in, a, layout, k, rank, a.stride(2), a.stride(1), torch.float32, cfg)
    grad_b = _weight_grad(g, u.to(g.dtype), layout, experts, False, top_k,
                          torch.empty(experts, n, rank, device=g.device, dtype=torch.float32))
    grad_b = (grad_b * lora.scaling).permute(1, 2, 0).reshape(n, rank * experts).to(lora.b.dtype)
    grad_a = _weight_grad(du_in, inp, layout, experts, gather, top_k,
                          torch.empty(experts, rank, k, device=g.device, dtype=torch.float32))
    return d_inp, (grad_a.view(experts * rank, k).to(lora.a.dtype), grad_b)


def fused_moe_backward_triton(grad_out, layout: MoeLayout, x, gate_up, down, weights, ids, act, preact, y, *,
                              form: ExpertForm = PLAIN, biases: tuple[bool, bool] = (False, False),
                              u: tuple = (None, None), weight_grads: tuple[bool, bool] = (True, True)):
    """Gradients of `fused_moe` (x, gate_up, down, weights, then the gate/up and down biases when
    `biases` says the forward had them, else None, then A and B of `form`'s gate/up and down
    adapters, None where absent) from the forward's saved rows (`u`: each adapter's shrink);
    `form` gives the activation and the gate/up rows' order (its bias tensors are not read).
    `weight_grads` says whether gate_up's and down's gradients are wanted: a frozen expert tensor
    (LoRA on the experts) gets None, and its weight-gradient GEMM is skipped."""
    tokens, hidden = x.shape
    top_k = ids.shape[1]
    experts, inter = down.shape[0], down.shape[2]
    rows = layout.sorted_pairs.shape[0]
    pair_y = y[layout.pair_pos].view(tokens, top_k, hidden).float()
    grad_weights = (grad_out.float()[:, None, :] * pair_y).sum(-1)
    dy = torch.zeros(rows, hidden, device=x.device, dtype=x.dtype)
    dy[layout.pair_pos] = (weights.float()[:, :, None] * grad_out.float()[:, None, :]).reshape(-1, hidden).to(x.dtype)
    # d_act[p, i] = sum_h dy[p, h] down[e, h, i]: W element (n=i, k=h)
    cfg = layout.config
    cutlass = expert_gemms(x, gate_up, down) == "grouped_mm"
    offsets = layout.expert_offsets[1:].to(torch.int32) if cutlass else None
    if cutlass:
        d_act = _cutlass_rows(dy, down, offsets)
    else:
        d_act = grouped_gemm(dy, down, layout, inter, hidden, down.stride(2), down.stride(1), torch.float32, cfg)
    adapter_grads = [(None, None), (None, None)]
    if form.down_lora is not None:
        d_act, adapter_grads[1] = _lora_backward(dy, act, d_act.float(), form.down_lora, u[1], layout, experts, top_k,
                                                 False)  # (its part is added into fp32 rows)
    d_gate, d_up = expert_activation_backward(preact[:, :inter], preact[:, inter:], d_act, form.clamp)
    d_gate_up = form.join(d_gate, d_up).to(x.dtype)  # in the weight rows' order
    # dx_p[h] = sum_j d_gate_up[p, j] gate_up[e, j, h]: W element (n=h, k=j)
    grad_gate_up = grad_down = None
    if cutlass:
        dx_pairs = _cutlass_rows(d_gate_up, gate_up, offsets)
        if weight_grads[1]:
            grad_down = _cutlass_weight_grad(dy, act, offsets)
        if weight_grads[0]:
            grad_gate_up = _cutlass_weight_grad(d_gate_up, _token_rows(x, layout, top_k), offsets)
    else:
        dx_pairs = grouped_gemm(d_gate_up, gate_up, layout, hidden, 2 * inter, gate_up.stride(2), gate_up.stride(1),
                                torch.float32, cfg)
        if weight_grads[1]:
            grad_down = _weight_grad(dy, act, layout, experts, False, top_k,
                                     torch.empty(down.shape, device=x.device, dtype=down.dtype))
        if weight_grads[0]:
            grad_gate_up = _weight_grad(d_gate_up, x, layout, experts, True, top_k,
                                        torch.empty(gate_up.shape, device=x.device, dtype=gate_up.dtype))
    if form.gate_up_lora is not None:
        dx_pairs, adapter_grads[0] = _lora_backward(d_gate_up, x, dx_pairs.float(), form.gate_up_lora, u[0], layout,
                                                    experts, top_k, True)
    grad_x = combine(dx_pairs, torch.ones_like(weights, dtype=torch.float32), layout, tokens, x.dtype)
    expert_of_pair = ids.reshape(-1)
    bias_grads = tuple(
        torch.zeros(experts, g.shape[1], device=x.device, dtype=torch.float32).index_add_(
            0, expert_of_pair, g[layout.pair_pos].float()).to(x.dtype) if wanted else None
        for wanted, g in zip(biases, (d_gate_up, dy)))
    return (grad_x, grad_gate_up, grad_down, grad_weights.to(weights.dtype), *bias_grads, *adapter_grads[0],
            *adapter_grads[1])


def fused_moe_backward_reference(grad_out, x, gate_up, down, weights, ids, form: ExpertForm = PLAIN):
    """Gradients of `fused_moe` (x, gate_up, down, weights, gate/up bias, down bias, then the
    gate/up adapter's A and B and the down adapter's; None for an absent one) by autograd through
    `moe_math` in fp32 (fp64 for fp64)."""
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    gu, dn = form.gate_up_lora, form.down_lora
    inputs = (x, gate_up, down, weights, form.gate_up_bias, form.down_bias, *((None, None) if gu is None else
                                                                              (gu.a, gu.b)),
              *((None, None) if dn is None else (dn.a, dn.b)))
    with torch.enable_grad():
        leaves = [None if t is None else t.detach().to(compute).requires_grad_() for t in inputs]
        out = moe_math(*leaves[:4], ids, ExpertForm(
            leaves[4], leaves[5], form.clamp, form.interleaved,
            None if gu is None else ExpertLora(leaves[6], leaves[7], gu.scaling),
            None if dn is None else ExpertLora(leaves[8], leaves[9], dn.scaling)))
        present = [t for t in leaves if t is not None]
        grads = iter(torch.autograd.grad(out, present, grad_out.to(compute)))
    return tuple(None if t is None else next(grads).to(t.dtype) for t in inputs)


def moe_math(x, gate_up, down, weights, ids, form: ExpertForm = PLAIN) -> torch.Tensor:
    """Plain-torch, differentiable MoE (the test oracle and the reference backward), with
    `form`'s biases, adapters, activation and gate/up order."""
    out = torch.zeros(x.shape, dtype=torch.promote_types(x.dtype, weights.dtype), device=x.device)
    experts = gate_up.shape[0]
    for expert in torch.unique(ids).tolist():
        t, r = (ids == expert).nonzero(as_tuple=True)
        gu = x[t] @ gate_up[expert].t()
        if form.gate_up_bias is not None:
            gu = gu + form.gate_up_bias[expert]
        if form.gate_up_lora is not None:
            gu = gu + expert_lora_math(x[t], form.gate_up_lora, expert, experts)
        act = expert_activation_math(*form.split(gu), form.clamp)
        y = act @ down[expert].t()
        if form.down_bias is not None:
            y = y + form.down_bias[expert]
        if form.down_lora is not None:
            y = y + expert_lora_math(act, form.down_lora, expert, experts)
        out = out.index_add(0, t, y * weights[t, r][:, None])
    return out.to(x.dtype)
