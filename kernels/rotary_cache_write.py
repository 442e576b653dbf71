"""rotary_cache_write: a rollout's per-head q/k norms, rotary embedding and KV cache write in one
launch.

A decode step of Qwen3 ran five small kernels per layer between the q/k/v projection and the
attention: q_norm, k_norm, the rotary embedding of q and of k, and the cache write of k and v
(Llama and Qwen2: three, without the norms). Each reads and writes a few hundred KB, so each costs
its launch more than its bytes. This op does all of them in one kernel: programs of kind 0 rotate
the query heads into a new tensor, of kind 1 the key heads into the K cache, of kind 2 copy the
value heads into the V cache.

Invariance contract: bitwise ``rms_norm`` -> ``apply_rotary`` -> ``kv_cache_write``, the ops
training runs. The norm is the norm kernel's own code (`rms_norm.load_rows`, `normalize_rows`)
on its tile, rows per program and warps (`rms_norm.norm_tile`), so that the compiler gives the
tile the same layout and `tl.sum` adds each row in the same order (docs/design.md rule 3); the
normed rows are stored in the output, rounded as the norm kernel stores them, and read back for
the rotation, so that the rotation's own tile layout cannot reach back into the norm's. The
rotation is `rotary.rotate_halves`, the rotary kernel's explicit fused multiply-adds, from the
same fp32 table (rule 5). A first version, which rotated the normed tile in registers and let
the compiler contract ``a * b - c * d`` where it chose, differed from the separate ops in the
last bit of some values on the H200; `tests/triton_checks/check_rotary_cache_write.py` and
`conformance/kernel_invariance.py` ("rotary_cache_write") check the bits there. The CPU reference
is the composition itself. Qwen3-Next's and Qwen3.5's heads are taken too: zero-centred norms
(`rms_norm.normalize_rows_centred`, `rms_norm(zero_centred=True)`'s code) and partial rotary (a
table narrower than half the head: the first dims rotated, the rest stored as normed or copied, as
`apply_rotary` does). Forward only: a rollout needs no gradient, so calls that do (and
shapes the kernel does not take) run the composition.
"""

from __future__ import annotations

import torch

from ._triton import next_power_of_2, require_triton, tl, triton
from .backend import select
from .dependent_launch import dependent_launch_kwargs, wait_for_inputs
from .kv_cache_write import check_cache_rows, kv_cache_write
from .rms_norm import load_rows, norm_launch_tile, normalize_rows, normalize_rows_centred, rms_norm
from .rotary import apply_rotary, rotate_rows_into


@triton.jit
def _rotate_rows_into(x_ptr, stride_t, stride_h, heads, n_rows, w_ptr, dest_ptr, slot_ptr, stride_dest, stride_dest_h,
                      pos_ptr, cos_ptr, sin_ptr, stride_table, eps, head_dim, rows, TO_SLOTS: tl.constexpr,
                      NORM: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr, ZERO_CENTRED: tl.constexpr):
    """Rows `rows` of the ``[T, heads, HEAD_DIM]`` view at `x_ptr`, normed (with `NORM`; the
    ``1 + weight`` norm with `ZERO_CENTRED`) and their first ``2 * HALF`` dims rotated, written to
    `dest_ptr`: at row ``token * stride_dest + head * stride_dest_h``, or with `TO_SLOTS` at row
    ``slot_ptr[token]`` of a cache (skipped where it is -1)."""
    cols = tl.arange(0, HEAD_DIM)
    ok = rows < n_rows
    rows64 = rows.to(tl.int64)
    token, head = rows64 // heads, rows64 % heads
    if TO_SLOTS:
        slot = tl.load(slot_ptr + token, mask=ok, other=-1).to(tl.int64)
        ok = ok & (slot >= 0)
        dest_row = slot * stride_dest + head * stride_dest_h
    else:
        dest_row = token * stride_dest + head * stride_dest_h
    src, src_row = x_ptr, token * stride_t + head * stride_h
    if NORM:  # the norm kernel's code on its tile, stored in the destination as it stores its output
        x, mask, _ = load_rows(x_ptr, rows, n_rows, cols, head_dim, heads, stride_t, stride_h)
        if ZERO_CENTRED:
            y = normalize_rows_centred(x, w_ptr, cols, head_dim, eps)
        else:
            y = normalize_rows(x, w_ptr, cols, head_dim, eps)
        tl.store(dest_ptr + dest_row[:, None] + cols[None, :], y.to(dest_ptr.dtype.element_ty), mask=mask & ok[:, None])
        tl.debug_barrier()  # the rotation below reads those rows back, in another layout
        src, src_row = dest_ptr, dest_row
    elif 2 * HALF < HEAD_DIM:  # partial rotary without a norm: the dims past the rotated ones, copied
        rest = ok[:, None] & (cols >= 2 * HALF)[None, :]
        tl.store(dest_ptr + dest_row[:, None] + cols[None, :], tl.load(x_ptr + src_row[:, None] + cols[None, :], mask=rest),
                 mask=rest)
    pos = tl.load(pos_ptr + token, mask=ok, other=0).to(tl.int64)
    # ".cg": read from L2, where the stores above landed, never from a stale L1 line
    rotate_rows_into(src, src_row, dest_ptr, dest_row, ok, pos, cos_ptr, sin_ptr, stride_table, HALF, False, ".cg")


@triton.jit
def _rotary_cache_write_kernel(
    q_ptr, k_ptr, v_ptr, pos_ptr, cos_ptr, sin_ptr, q_w_ptr, k_w_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    n_tokens, q_heads, kv_heads, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_ot, stride_oh, stride_kc, stride_vc, stride_table, eps, head_dim,
    HEAD_DIM: tl.constexpr, ROWS: tl.constexpr, NORM: tl.constexpr, PDL: tl.constexpr = False,
    HALF: tl.constexpr = 0, ZERO_CENTRED: tl.constexpr = False,
):
    wait_for_inputs(PDL)
    kind = tl.program_id(1)  # 0: query heads, 1: key heads, 2: value heads
    if tl.program_id(0) * ROWS >= n_tokens * tl.where(kind == 0, q_heads, kv_heads):
        return  # the grid spans the query rows; the key and value kinds have fewer
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    if kind == 0:
        _rotate_rows_into(q_ptr, stride_qt, stride_qh, q_heads, n_tokens * q_heads, q_w_ptr, q_out_ptr, slot_ptr,
                          stride_ot, stride_oh, pos_ptr, cos_ptr, sin_ptr, stride_table, eps, head_dim, rows,
                          False, NORM, HEAD_DIM, HALF, ZERO_CENTRED)
    elif kind == 1:
        _rotate_rows_into(k_ptr, stride_kt, stride_kh, kv_heads, n_tokens * kv_heads, k_w_ptr, k_cache_ptr, slot_ptr,
                          stride_kc, HEAD_DIM, pos_ptr, cos_ptr, sin_ptr, stride_table, eps, head_dim, rows,
                          True, NORM, HEAD_DIM, HALF, ZERO_CENTRED)
    else:  # values: copied as they are
        cols = tl.arange(0, HEAD_DIM)
        ok = rows < n_tokens * kv_heads
        rows64 = rows.to(tl.int64)
        token, head = rows64 // kv_heads, rows64 % kv_heads
        v = tl.load(v_ptr + (token * stride_vt + head * stride_vh)[:, None] + cols[None, :], mask=ok[:, None])
        slot = tl.load(slot_ptr + token, mask=ok, other=-1).to(tl.int64)
        dest = v_cache_ptr + (slot * stride_vc + head * HEAD_DIM)[:, None] + cols[None, :]
        tl.store(dest, v, mask=(ok & (slot >= 0))[:, None])


def _fusable(q, k, v, k_cache, v_cache, weights, half) -> bool:
    """Whether the kernel takes these inputs: no gradient wanted, the triton backend, a power-of-two
    head dim shared by q, k and v and a power-of-two rotary half (`half` table columns), unit last
    strides, plain (not sharded) norm weights."""
    head_dim = q.shape[-1]
    tensors = (q, k, v, *(w for w in weights if w is not None))
    return (not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))
            and select("rotary", q) == "triton" and select("rms_norm", q) == "triton"
            and head_dim >= 2 and head_dim == next_power_of_2(head_dim) and half == next_power_of_2(half)
            and k.shape[-1] == v.shape[-1] == head_dim and q.dtype == k_cache.dtype
            and all(t.stride(-1) == 1 for t in (q, k, v))
            and all(type(w) in (torch.Tensor, torch.nn.Parameter) for w in weights if w is not None))


def _check(q, k, v, positions, k_cache, v_cache, slot_mapping, q_weight, k_weight) -> None:
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"rotary_cache_write: q, k, v must be [tokens, heads, head_dim], got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    tokens = q.shape[0]
    if k.shape[0] != tokens or v.shape[0] != tokens or positions.shape != (tokens,) or slot_mapping.shape != (tokens,):
        raise ValueError(f"rotary_cache_write: q has {tokens} tokens but k {k.shape[0]}, v {v.shape[0]}, "
                         f"positions {tuple(positions.shape)}, slot_mapping {tuple(slot_mapping.shape)}")
    if (q_weight is None) != (k_weight is None):
        raise ValueError("rotary_cache_write: pass both q_weight and k_weight (Qwen3's q/k norms) or neither")
    if q_weight is not None and (q_weight.shape != (q.shape[-1],) or k_weight.shape != (k.shape[-1],)):
        raise ValueError(f"rotary_cache_write: norm weights {tuple(q_weight.shape)}/{tuple(k_weight.shape)} must be "
                         f"({q.shape[-1]},)/({k.shape[-1]},)")
    check_cache_rows(k, v, k_cache, v_cache, "rotary_cache_write")


def rotary_cache_write_reference(q, k, v, positions, cos, sin, k_cache, v_cache, slot_mapping,
                                 q_weight=None, k_weight=None, eps: float = 1e-6, zero_centred: bool = False) -> torch.Tensor:
    """The composition the kernel equals: the optional norms, the rotations, the cache write."""
    if q_weight is not None:
        q, k = rms_norm(q, q_weight, eps, zero_centred), rms_norm(k, k_weight, eps, zero_centred)
    q, k = apply_rotary(q, positions, cos, sin), apply_rotary(k, positions, cos, sin)
    kv_cache_write(k, v, k_cache, v_cache, slot_mapping)
    return q


def rotary_cache_write(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                       cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       slot_mapping: torch.Tensor, q_weight: torch.Tensor | None = None,
                       k_weight: torch.Tensor | None = None, eps: float = 1e-6,
                       tile: tuple[int, int] | None = None, zero_centred: bool = False) -> torch.Tensor:
    """Rotate the queries and write the rotated keys and the values into the KV cache.

    Args:
        q, k, v: ``[tokens, heads, head_dim]`` (views of one fused projection are fine).
        positions: ``[tokens]`` absolute positions, indexing the ``[max_positions, rotary_dim/2]``
            fp32 `cos`/`sin` tables of `rope_table` (``rotary_dim < head_dim``: partial rotary, as
            `apply_rotary`).
        k_cache, v_cache: ``[..., kv_heads, head_dim]`` caches; ``slot_mapping [tokens]`` gives
            each token's row (-1: not written), as in `kv_cache_write`.
        q_weight, k_weight: per-head RMSNorm weights ``[head_dim]`` applied before the rotation
            (Qwen3), or both None (Llama, Qwen2); `eps` their epsilon; `zero_centred`: the
            ``1 + weight`` norms of Qwen3-Next and Qwen3.5 (`rms_norm`).
        tile: ``(rows per program, warps)`` in place of the norm kernel's (`rms_norm.norm_launch_tile`;
            launch-shape sweeps only: the normed rows then match ``rms_norm_triton`` at that tile).
    Returns:
        The rotated queries ``[tokens, heads, head_dim]`` in q's dtype; the caches are written in
        place. Bitwise what `rotary_cache_write_reference` gives.
    """
    _check(q, k, v, positions, k_cache, v_cache, slot_mapping, q_weight, k_weight)
    norm_launch_tile("rotary_cache_write", q.shape[-1], tile)  # a bad tile is refused on every path
    if not _fusable(q, k, v, k_cache, v_cache, (q_weight, k_weight), cos.shape[-1]):
        return rotary_cache_write_reference(q, k, v, positions, cos, sin, k_cache, v_cache, slot_mapping,
                                            q_weight, k_weight, eps, zero_centred)
    require_triton("rotary_cache_write")
    tokens, q_heads, head_dim = q.shape
    kv_heads = k.shape[1]
    q_out = torch.empty((tokens, q_heads, head_dim), device=q.device, dtype=q.dtype)
    if tokens == 0:
        return q_out
    k_rows = k_cache.view(-1, kv_heads * head_dim)
    v_rows = v_cache.view(-1, kv_heads * head_dim)
    # the norm kernel's tile, rows and warps: its layout
    _, rows, num_warps = norm_launch_tile("rotary_cache_write", head_dim, tile)
    grid = (triton.cdiv(tokens * max(q_heads, kv_heads), rows), 3)
    norm = q_weight is not None
    _rotary_cache_write_kernel[grid](
        q, k, v, positions, cos, sin, q_weight if norm else cos, k_weight if norm else cos, q_out, k_rows, v_rows,
        slot_mapping, tokens, q_heads, kv_heads, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        v.stride(0), v.stride(1), q_out.stride(0), q_out.stride(1), k_rows.stride(0), v_rows.stride(0),
        cos.stride(0), eps, head_dim, HEAD_DIM=head_dim, ROWS=rows, NORM=norm, num_warps=num_warps,
        HALF=cos.shape[-1], ZERO_CENTRED=zero_centred and norm, **dependent_launch_kwargs(q.device), enable_fp_fusion=True)
    return q_out
