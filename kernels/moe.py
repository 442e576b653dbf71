"""fused_moe: the routed experts of a MoE block, batch-invariant, with a backward.

``out[t] = sum_r w[t, r] * down[e] @ (silu(gate[e] @ x[t]) * (up[e] @ x[t]))`` with
``e = ids[t, r]``, the sum over ranks r = 0..k-1 in that order, in fp32, then one cast
(docs/design.md rule 4). Expert weights are HF's fused 3-D tensors: ``gate_up_proj [E, 2I, H]``
(gate rows first) and ``down_proj [E, H, I]``.

How: `moe_align` (moe_align.py) sorts the (token, rank) pairs by expert (stable: by pair
index within an expert) and pads each expert's segment to its tile config's rows (`moe_config.py`), into a buffer whose
size is a static bound (no host sync: CUDA-graph safe). One grouped GEMM computes gate and up for a tile
of one expert's rows and applies SiLU-and-mul in its epilogue (each product rounded to the
input dtype first, as the dense path does); a second grouped GEMM applies ``down``; a combine
kernel sums each token's k rows in rank order.

Invariance contract: a pair's row is computed with K accumulated sequentially in fp32 in
16-wide MMA steps over K tiles of 64 or 128 (rule 1; `k_tile`) by a tile config chosen from the
batch shape only (`pick_config`; the configs give bitwise the same rows, proven on the GPU),
whatever number of rows its expert received (0, 1 or thousands) and wherever the row sits in
its tile; the combine order is the rank order (rule 4). The reference does the same per expert with `linear_reference`.
Backward (rule 8): grouped GEMMs for the input gradients, a grouped reduction kernel for the
weight gradients (`moe_backward.py`). The grouped GEMM and the combine, which the forward and the
backward both launch, are in `moe_grouped_gemm.py`.
"""

from __future__ import annotations

import torch

from ._triton import require_triton, tl, triton
from .backend import select
from .dependent_launch import dependent_launch_kwargs, wait_for_inputs
from .linear import linear_reference
from .moe_activation import (PLAIN, ExpertForm, SwigluClamp, expert_activation, expert_activation_reference,
                             expert_activation_rows)
from .moe_align import MoeLayout, moe_align
from .moe_lora import (GATE_FIRST_FROM_INTERLEAVED, IDENTITY, ExpertLora, moe_lora_add_reference, moe_lora_add_triton,
                       moe_lora_shrink_beside)
from .moe_backward import fused_moe_backward_reference, fused_moe_backward_triton
from .moe_config import MoeConfig, k_tile, pick_config
from .moe_grouped_gemm import combine, grouped_gemm, input_precision, tile_descriptor, weight_rows, weights_by_tma


@triton.jit
def _gate_up_tiles(x_ptrs, wg_ptrs, wu_ptrs, w_desc, valid, w_row, H, I, n_ok, stride_wk, offs_k,
                   INPUT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, W_DESC: tl.constexpr):
    """The gate and up products of gate rows first: a ``[BLOCK_K, BLOCK_N]`` tile of each a K step
    (through the descriptor with `W_DESC`: the same tiles, zero past H; columns past I read the
    next rows, never stored)."""
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k in range(0, tl.cdiv(H, BLOCK_K)):
        k_ok = offs_k < H - k * BLOCK_K
        a = tl.load(x_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
        if W_DESC:
            bg = w_desc.load([w_row, k * BLOCK_K]).T
            bu = w_desc.load([w_row + I, k * BLOCK_K]).T
        else:
            bg = tl.load(wg_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            bu = tl.load(wu_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc_g = tl.dot(a, bg, acc_g, input_precision=INPUT_PRECISION)
        acc_u = tl.dot(a, bu, acc_u, input_precision=INPUT_PRECISION)
        x_ptrs += BLOCK_K
        wg_ptrs += BLOCK_K * stride_wk
        wu_ptrs += BLOCK_K * stride_wk
    return acc_g, acc_u


@triton.jit
def _interleaved_gate_up_tiles(x_ptrs, w_ptrs, valid, H, I, rows_ok, stride_wk, offs_k,
                               INPUT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                               BLOCK_K: tl.constexpr):
    """GPT-OSS's interleaved rows (gate row n at 2n, up at 2n + 1): one ``[BLOCK_K, 2 BLOCK_N]``
    tile of consecutive rows a K step and one dot, split into gate and up columns after the K
    loop. Each product column sees the same K steps as a dot of its own (the columns of an MMA
    are independent, as every tile config's rows are: `pick_config`); the tile is contiguous
    where the two strided tiles of `_gate_up_tiles` were not (element loads, no async copies)."""
    acc = tl.zeros((BLOCK_M, 2 * BLOCK_N), tl.float32)
    for k in range(0, tl.cdiv(H, BLOCK_K)):
        k_ok = offs_k < H - k * BLOCK_K
        a = tl.load(x_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_ptrs, mask=k_ok[:, None] & rows_ok[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_wk
    return tl.split(tl.reshape(acc, (BLOCK_M, BLOCK_N, 2)))


@triton.jit
def moe_gate_up_kernel(x_ptr, w_ptr, w_desc, act_ptr, preact_ptr, sorted_pairs_ptr, block_expert_ptr,
                       num_pairs, H, I, stride_xt, stride_we, stride_wn, stride_wk, stride_act, stride_pre,
                       TOP_K: tl.constexpr, SAVE_PREACT: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, W_DESC: tl.constexpr,
                       PDL: tl.constexpr = False, up_offset=0, bias_ptr=None, stride_be=0, bias_step=1,
                       bias_up=0, alpha=1.0, limit=1.0, BIAS: tl.constexpr = False, CLAMPED: tl.constexpr = False,
                       STORE_ACT: tl.constexpr = True, INTERLEAVED: tl.constexpr = False):
    """Gate and up GEMMs of the expert-sorted rows (`moe_align`) with the activation in the
    epilogue: ``act = silu(x @ Wg[e].T) * (x @ Wu[e].T)`` per block of rows of one expert
    (rule 4). Gate row n of expert e at ``stride_we * e + stride_wn * n``, its up row
    `up_offset` further (rows first: ``I * stride_wn``); with `INTERLEAVED` (GPT-OSS) row r of
    ``[E, 2I, H]`` at ``stride_we * e + stride_wn * r``, gate row n at r = 2n, up at 2n + 1.
    With `BIAS` each rounded product gets its bias (``bias_ptr[e, n * bias_step]``, up
    `bias_up` further) and is rounded again; with `CLAMPED` the activation is the clamped SwiGLU
    (`moe_activation.expert_activation`). Public for benchmarks/moe.py, which times it alone;
    models call `fused_moe`."""
    wait_for_inputs(PDL)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pairs_ptr + offs_m)
    valid = pairs < num_pairs
    token = (pairs // TOP_K).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < I
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + token[:, None] * stride_xt + offs_k[None, :]
    if INTERLEAVED:
        offs_r = pid_n * 2 * BLOCK_N + tl.arange(0, 2 * BLOCK_N)
        w_ptrs = w_ptr + expert * stride_we + offs_r[None, :] * stride_wn + offs_k[:, None] * stride_wk
        acc_g, acc_u = _interleaved_gate_up_tiles(x_ptrs, w_ptrs, valid, H, I, offs_r < 2 * I, stride_wk, offs_k,
                                                  INPUT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)
    else:
        wg_ptrs = w_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk
        w_row = expert.to(tl.int32) * 2 * I + pid_n * BLOCK_N  # W_DESC: the gate tile's first row in [E * 2I, H]
        acc_g, acc_u = _gate_up_tiles(x_ptrs, wg_ptrs, wg_ptrs + up_offset, w_desc, valid, w_row, H, I, n_ok,
                                      stride_wk, offs_k, INPUT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K, W_DESC)
    dtype = act_ptr.dtype.element_ty
    g = acc_g.to(dtype)
    u = acc_u.to(dtype)
    if BIAS:  # stock's ``x @ W + b``: the product rounded, the bias added, rounded again
        b_ptrs = bias_ptr + expert * stride_be + offs_n * bias_step
        g = (g.to(tl.float32) + tl.load(b_ptrs, mask=n_ok, other=0.0).to(tl.float32)[None, :]).to(dtype)
        u = (u.to(tl.float32) + tl.load(b_ptrs + bias_up, mask=n_ok, other=0.0).to(tl.float32)[None, :]).to(dtype)
    rows = offs_m.to(tl.int64)[:, None]
    if STORE_ACT:
        act = expert_activation(g.to(tl.float32), u.to(tl.float32), alpha, limit, CLAMPED)
        tl.store(act_ptr + rows * stride_act + offs_n[None, :], act.to(dtype), mask=n_ok[None, :])
    if SAVE_PREACT:
        tl.store(preact_ptr + rows * stride_pre + offs_n[None, :], g, mask=n_ok[None, :])
        tl.store(preact_ptr + rows * stride_pre + I + offs_n[None, :], u, mask=n_ok[None, :])


def gate_up_act(x: torch.Tensor, gate_up: torch.Tensor, layout: MoeLayout, top_k: int, cfg: MoeConfig,
                save_preact: bool = False, form: ExpertForm = PLAIN,
                store_act: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``act[p] = silu(x[t] @ Wg[e].T) * (x[t] @ Wu[e].T)`` over the padded permuted rows of
    `layout` (pair p = t * top_k + r of expert e), by `moe_gate_up_kernel` with `cfg`'s tiles; with
    `form`'s gate/up biases, clamped activation and interleaved rows. Returns (act, preact):
    preact holds the rounded gate and up products (biases added; gate columns first whatever the
    form) when `save_preact` (the backward's input), else it is `act` itself. Without `store_act`
    (needs `save_preact`) act is None: only the products are computed."""
    hidden = x.shape[1]
    inter = gate_up.shape[1] // 2
    rows = layout.sorted_pairs.shape[0]
    preact = torch.empty(rows, 2 * inter, device=x.device, dtype=x.dtype) if save_preact else None
    act = torch.empty(rows, inter, device=x.device, dtype=x.dtype) if store_act else None
    preact = act if preact is None else preact
    block_k = k_tile(cfg.block_k, hidden)
    desc = cfg.tma and not form.interleaved and weights_by_tma(gate_up, 2 * inter, hidden, gate_up.stride(1),
                                                               gate_up.stride(2))
    w_desc = tile_descriptor(weight_rows(gate_up, 2 * inter, hidden), cfg.block_n, block_k) if desc else None
    row_step = 2 if form.interleaved else 1
    bias = form.gate_up_bias
    extra = dict(up_offset=gate_up.stride(1) * inter, BIAS=bias is not None,
                 CLAMPED=form.clamp is not None)
    if bias is not None:
        bias = bias.contiguous()
        extra.update(bias_ptr=bias, stride_be=bias.stride(0), bias_step=row_step,
                     bias_up=1 if form.interleaved else inter)
    if form.clamp is not None:
        extra.update(alpha=float(form.clamp.alpha), limit=float(form.clamp.limit))
    moe_gate_up_kernel[(rows // cfg.block_m, triton.cdiv(inter, cfg.block_n))](
        x, gate_up, w_desc, preact if act is None else act, preact, layout.sorted_pairs, layout.block_expert,
        layout.num_pairs, hidden, inter, x.stride(0), gate_up.stride(0), gate_up.stride(1),
        gate_up.stride(2), inter if act is None else act.stride(0), preact.stride(0), TOP_K=top_k,
        SAVE_PREACT=save_preact, STORE_ACT=act is not None, INPUT_PRECISION=input_precision(x.dtype),
        INTERLEAVED=form.interleaved,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=block_k, W_DESC=desc, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **extra, **dependent_launch_kwargs(x.device), enable_fp_fusion=True)
    return act, preact


def _forward_triton(x, gate_up, down, weights, ids, save_preact: bool, add: torch.Tensor | None = None,
                    add_ready: torch.cuda.Event | None = None, form: ExpertForm = PLAIN):
    require_triton("fused_moe")
    tokens, hidden = x.shape
    experts, inter = down.shape[0], down.shape[2]
    cfg = pick_config(tokens, ids.shape[1], experts)
    layout = moe_align(ids, experts, cfg.block_m)
    layout.config = cfg
    top_k, u = ids.shape[1], [None, None]  # the adapters' u rows (the backward's)
    if form.gate_up_lora is None:
        act, preact = gate_up_act(x, gate_up, layout, top_k, cfg, save_preact, form)
    else:  # the products, their update (moe_lora.py), then the epilogue's activation
        started = None if save_preact else moe_lora_shrink_beside(x, form.gate_up_lora, layout, experts, top_k, True)
        preact = gate_up_act(x, gate_up, layout, top_k, cfg, True, form, store_act=False)[1]
        u[0] = moe_lora_add_triton(preact, x, form.gate_up_lora, layout, experts, top_k, True,
                                   GATE_FIRST_FROM_INTERLEAVED if form.interleaved else IDENTITY, save_preact, started)
        act = expert_activation_rows(preact, form.clamp, layout.block_expert, cfg.block_m)
    started = None if form.down_lora is None or save_preact else \
        moe_lora_shrink_beside(act, form.down_lora, layout, experts, top_k, False)
    y = grouped_gemm(act, down, layout, hidden, inter, down.stride(1), down.stride(2), x.dtype, cfg, down_tiles=True,
                     bias=form.down_bias)
    if form.down_lora is not None:
        u[1] = moe_lora_add_triton(y, act, form.down_lora, layout, experts, top_k, False, IDENTITY, save_preact,
                                   started)
    if add_ready is not None:  # `add` comes from another stream: the combine is its first reader
        torch.cuda.current_stream(x.device).wait_event(add_ready)
    out = combine(y, weights, layout, tokens, x.dtype, add)
    return out, (layout, act, preact, y, *u)


def add_bias_rounded(y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``y + bias`` as stock's ``x @ W + b`` rounds it: the rounded product widened, the bias
    added in fp32 (fp64 for fp64), rounded once more to y's dtype (the kernels' epilogues)."""
    if bias is None:
        return y
    compute = torch.float64 if y.dtype == torch.float64 else torch.float32
    return (y.to(compute) + bias.to(compute)).to(y.dtype)


def fused_moe_reference(x, gate_up, down, weights, ids, form: ExpertForm = PLAIN) -> torch.Tensor:
    """Per expert, `linear_reference` rows (row-invariant on CPU), `form`'s biases, adapters
    (`moe_lora.moe_lora_add_reference`) and activation; ranks combined in order."""
    tokens, top_k = ids.shape
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    y = torch.zeros(tokens, top_k, x.shape[1], dtype=x.dtype)
    for expert in torch.unique(ids).tolist():
        t, r = (ids == expert).nonzero(as_tuple=True)
        gu = linear_reference(x[t], gate_up[expert], None, x.dtype)
        gu = add_bias_rounded(gu, None if form.gate_up_bias is None else form.gate_up_bias[expert])
        if form.gate_up_lora is not None:
            gu = moe_lora_add_reference(gu, x[t], form.gate_up_lora, expert, gate_up.shape[0])
        act = expert_activation_reference(*form.split(gu), form.clamp)
        y_e = add_bias_rounded(linear_reference(act, down[expert], None, x.dtype),
                               None if form.down_bias is None else form.down_bias[expert])
        if form.down_lora is not None:
            y_e = moe_lora_add_reference(y_e, act, form.down_lora, expert, gate_up.shape[0])
        y[t, r] = y_e
    out = torch.zeros(tokens, x.shape[1], dtype=compute)
    w = weights.to(compute)
    for r in range(top_k):
        out = out + w[:, r:r + 1] * y[:, r].to(compute)
    return out.to(x.dtype)


def _lora(a, b, scaling) -> ExpertLora | None:
    return None if a is None else ExpertLora(a, b, scaling)


class _FusedMoeFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, gate_up, down, weights, ids, backend, gate_up_bias, down_bias, clamp, interleaved,
                gu_a, gu_b, gu_scaling, down_a, down_b, down_scaling):
        form = ExpertForm(gate_up_bias, down_bias, clamp, interleaved, _lora(gu_a, gu_b, gu_scaling),
                          _lora(down_a, down_b, down_scaling))
        ctx.backend, ctx.clamp, ctx.interleaved = backend, clamp, interleaved
        ctx.scalings = (gu_scaling, down_scaling)
        ctx.biases = (gate_up_bias is not None, down_bias is not None)
        adapters = (gu_a, gu_b, down_a, down_b)
        if backend == "reference":
            ctx.save_for_backward(x, gate_up, down, weights, ids, gate_up_bias, down_bias, *adapters)
            return fused_moe_reference(x, gate_up, down, weights, ids, form)
        out, (layout, act, preact, y, u_gu, u_down) = _forward_triton(x, gate_up, down, weights, ids,
                                                                      save_preact=True, form=form)
        ctx.save_for_backward(x, gate_up, down, weights, ids, act, preact, y, *adapters, u_gu, u_down)
        ctx.layout = layout
        return out

    @staticmethod
    def backward(ctx, grad_out):
        if ctx.backend == "reference":
            x, gate_up, down, weights, ids, gate_up_bias, down_bias, gu_a, gu_b, down_a, down_b = ctx.saved_tensors
            form = ExpertForm(gate_up_bias, down_bias, ctx.clamp, ctx.interleaved, _lora(gu_a, gu_b, ctx.scalings[0]),
                              _lora(down_a, down_b, ctx.scalings[1]))
            grads = fused_moe_backward_reference(grad_out, x, gate_up, down, weights, ids, form)
        else:
            *saved, gu_a, gu_b, down_a, down_b, u_gu, u_down = ctx.saved_tensors
            form = ExpertForm(None, None, ctx.clamp, ctx.interleaved, _lora(gu_a, gu_b, ctx.scalings[0]),
                              _lora(down_a, down_b, ctx.scalings[1]))
            grads = fused_moe_backward_triton(grad_out.contiguous(), ctx.layout, *saved, form=form,
                                              biases=ctx.biases, u=(u_gu, u_down),
                                              weight_grads=tuple(ctx.needs_input_grad[1:3]))
        # x, gate_up, down, weights, ids, backend, the biases, clamp, interleaved, then each
        # adapter's A, B and scaling
        return (*grads[:4], None, None, *grads[4:6], None, None, grads[6], grads[7], None, grads[8], grads[9], None)


def _check_form(x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor, form: ExpertForm) -> None:
    """ValueErrors naming a bias of the wrong shape, dtype or device."""
    experts, hidden = down_proj.shape[0], down_proj.shape[1]
    for name, bias, shape in (("gate_up_bias", form.gate_up_bias, (experts, gate_up_proj.shape[1])),
                              ("down_bias", form.down_bias, (experts, hidden))):
        if bias is not None and (tuple(bias.shape) != shape or bias.dtype != x.dtype or bias.device != x.device):
            raise ValueError(f"fused_moe: {name} must be {list(shape)} {x.dtype} on {x.device} (like x); got "
                             f"{list(bias.shape)} {bias.dtype} on {bias.device}")
    if form.clamp is not None and not isinstance(form.clamp, SwigluClamp):
        raise ValueError(f"fused_moe: clamp={form.clamp!r} must be a SwigluClamp or None")
    for name, lora, n, k in (("gate_up_lora", form.gate_up_lora, gate_up_proj.shape[1], hidden),
                             ("down_lora", form.down_lora, hidden, down_proj.shape[2])):
        if lora is not None:
            if not isinstance(lora, ExpertLora):
                raise ValueError(f"fused_moe: {name}={lora!r} must be a kernels.moe_lora.ExpertLora or None")
            lora.check(name, experts, k, n, x)


def fused_moe(x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, add: torch.Tensor | None = None,
              add_ready: torch.cuda.Event | None = None, *, gate_up_bias: torch.Tensor | None = None,
              down_bias: torch.Tensor | None = None, clamp: SwigluClamp | None = None,
              interleaved: bool = False, gate_up_lora: ExpertLora | None = None,
              down_lora: ExpertLora | None = None) -> torch.Tensor:
    """Routed-expert output ``[T, H]`` for ``x [T, H]`` (see the module docstring), plus `add`.

    Args:
        gate_up_proj: ``[E, 2I, H]`` (any strides: GPT-OSS passes its ``[E, H, 2I]`` parameter
            transposed); down_proj: ``[E, H, I]`` (likewise) (x's dtype).
        topk_weights: ``[T, k]`` (fp32, rank order); topk_ids: ``[T, k]`` int.
        add: optional ``[T, H]`` in x's dtype (DeepSeek's shared experts): the result is then
            bitwise ``fused_moe(...) + add``; without gradients the Triton path adds it inside
            its combine kernel, a launch fewer.
        add_ready: an event recorded after `add` was computed on another stream
            (`vexact_models.side_stream.beside`: the shared experts beside the routed ones); the
            current stream waits for it before `add` is first read: in the Triton path just
            before the combine, so the routed experts run beside `add`'s computation.
        gate_up_bias: ``[E, 2I]`` (the gate/up rows' order), down_bias: ``[E, H]``: added to the
            rounded products and rounded again, as stock's ``x @ W + b`` (GPT-OSS).
        clamp: GPT-OSS's clamped SwiGLU (`moe_activation.SwigluClamp`) instead of SwiGLU.
        interleaved: gate/up rows interleaved (gate row n at 2n, up at 2n + 1; GPT-OSS) instead
            of all gate rows first.
        gate_up_lora, down_lora: a LoRA adapter on either expert tensor (`moe_lora.ExpertLora`,
            PEFT's ``target_parameters`` layout: A ``[E * r, K]``, B ``[N, r * E]``, N in the
            tensor's output rows' order): its update is added to the rounded (and biased)
            products of each pair's expert (`moe_lora.py`'s arithmetic).
    Differentiable in x, both weight tensors, both biases, topk_weights, add and the adapters'
    A and B.
    """
    if x.dim() != 2 or gate_up_proj.shape[2] != x.shape[1] or down_proj.shape[1] != x.shape[1] \
            or gate_up_proj.shape[1] != 2 * down_proj.shape[2] or gate_up_proj.shape[0] != down_proj.shape[0]:
        raise ValueError(f"fused_moe: shapes x {tuple(x.shape)}, gate_up_proj {tuple(gate_up_proj.shape)}, "
                         f"down_proj {tuple(down_proj.shape)} do not fit [T,H], [E,2I,H], [E,H,I]")
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"fused_moe: topk_ids {tuple(topk_ids.shape)} and topk_weights "
                         f"{tuple(topk_weights.shape)} must both be [{x.shape[0]}, k]")
    form = ExpertForm(gate_up_bias, down_bias, clamp, bool(interleaved), gate_up_lora, down_lora)
    _check_form(x, gate_up_proj, down_proj, form)
    backend = select("fused_moe", x)
    x = x.contiguous()
    ids = topk_ids.to(torch.int64)
    if add is not None and (add.shape != x.shape or add.dtype != x.dtype or add.device != x.device):
        raise ValueError(f"fused_moe: add must be [{x.shape[0]}, {x.shape[1]}] {x.dtype} on {x.device} like x; "
                         f"got {tuple(add.shape)} {add.dtype} on {add.device}")
    if add_ready is not None and add is None:
        raise ValueError("fused_moe: add_ready was given without add; it says when add is ready to read")
    adapter_args = [t for lora in (gate_up_lora, down_lora) for t in ((None, None, None) if lora is None else
                                                                      (lora.a, lora.b, float(lora.scaling)))]
    needs_grad = torch.is_grad_enabled() and any(
        torch.is_tensor(t) and t.requires_grad for t in (x, gate_up_proj, down_proj, topk_weights, add, gate_up_bias,
                                                         down_bias, *adapter_args))
    plain_add = needs_grad or backend == "reference"  # the plain add after the routed output
    if add_ready is not None and (plain_add or not add.is_contiguous()):
        # `add` is read before the combine (its add, or its copy below): wait for it now; `beside`
        # forks only where neither happens, so no overlap is lost in practice
        torch.cuda.current_stream(x.device).wait_event(add_ready)
        add_ready = None
    if plain_add:
        out = (_FusedMoeFunction.apply(x, gate_up_proj, down_proj, topk_weights, ids, backend, gate_up_bias, down_bias,
                                       form.clamp, form.interleaved, *adapter_args) if needs_grad
               else fused_moe_reference(x, gate_up_proj, down_proj, topk_weights, ids, form))
        return out if add is None else out + add
    add = None if add is None else add.contiguous()  # the combine kernel reads rows of unit stride
    return _forward_triton(x, gate_up_proj, down_proj, topk_weights, ids, save_preact=False, add=add,
                           add_ready=add_ready, form=form)[0]
