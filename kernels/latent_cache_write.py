"""latent_cache_write: a rollout's latent MLA query assembly, latent norm, rope rotations and
cache write in one launch.

Between its projections and its attention, a decode step of latent MLA (docs/mla-kv-cache.md) ran
nine small kernels per layer: a copy of the latent out of ``kv_a_proj_with_mqa``'s output, its
``kv_a_layernorm``, two de-interleaving copies and two rotations of the rope parts of the query
and the key, two concatenations (``[latent query, rotated rope query]`` and ``[normed latent,
rotated rope key]``) and the cache write. Each moves a few hundred KB, so each cost its launch
more than its bytes (~0.5 ms per Moonlight step at batch 256 on the H200). This op does all of
them in one kernel: programs of kind 0 assemble query rows ``(token, head)``, of kind 1 write key
rows into the cache.

Invariance contract: bitwise the ops training runs (`latent_cache_write_reference`): ``rms_norm``
of the latent, ``apply_rotary`` of the de-interleaved rope parts, the concatenations and
``kv_cache_write``. The norm is the norm kernel's own code (`rms_norm.load_rows`,
`normalize_rows`) on its tile, rows per program, warps and runtime row length
(`rms_norm.norm_tile`), so that the compiler gives the tile the same layout and `tl.sum` adds
each row in the same order (docs/design.md rule 3). The rotation is `rotary.rotate_halves`, the
rotary kernel's explicit fused multiply-adds on the same fp32 table (rule 5); de-interleaving
and concatenating are loads from other addresses. `tests/triton_checks/check_latent_cache_write.py`
and `conformance/kernel_invariance.py` ("latent_cache_write") check the bits. Forward only: calls
that want a gradient (and inputs the kernel does not take) run the composition.
"""

from __future__ import annotations

import torch

from ._triton import next_power_of_2, require_triton, tl, triton
from .backend import select
from .dependent_launch import dependent_launch_kwargs, wait_for_inputs
from .kv_cache_write import kv_cache_write
from .rms_norm import load_rows, norm_tile, normalize_rows, rms_norm
from .rotary import apply_rotary, deinterleave, rotate_rows_into


@triton.jit
def _latent_cache_write_kernel(
    q_lat_ptr, q_pe_ptr, kv_ptr, w_ptr, pos_ptr, cos_ptr, sin_ptr, q_out_ptr, cache_ptr, slot_ptr,
    n_tokens, heads, stride_qlt, stride_qlh, stride_qpt, stride_qph, stride_kv, stride_ot, stride_oh, stride_cache,
    stride_table, eps, rank, one, zero,
    RANK: tl.constexpr, ROPE: tl.constexpr, ROWS: tl.constexpr, INTERLEAVED: tl.constexpr, PDL: tl.constexpr = False,
):
    wait_for_inputs(PDL)
    kind = tl.program_id(1)  # 0: query rows (token, head); 1: key rows (token)
    if tl.program_id(0) * ROWS >= n_tokens * tl.where(kind == 0, heads, 1):
        return  # the grid spans the query rows; the key kind has fewer
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, RANK)
    if kind == 0:
        ok = rows < n_tokens * heads
        rows64 = rows.to(tl.int64)
        token, head = rows64 // heads, rows64 % heads
        q_lat = tl.load(q_lat_ptr + (token * stride_qlt + head * stride_qlh)[:, None] + cols[None, :], mask=ok[:, None])
        out_row = token * stride_ot + head * stride_oh
        tl.store(q_out_ptr + out_row[:, None] + cols[None, :], q_lat, mask=ok[:, None])
        pos = tl.load(pos_ptr + token, mask=ok, other=0).to(tl.int64)
        rotate_rows_into(q_pe_ptr, token * stride_qpt + head * stride_qph, q_out_ptr + RANK, out_row, ok, pos, cos_ptr,
                         sin_ptr, stride_table, ROPE // 2, INTERLEAVED, "")
    else:
        ok = rows < n_tokens
        token = rows.to(tl.int64)
        slot = tl.load(slot_ptr + token, mask=ok, other=-1).to(tl.int64)
        ok = ok & (slot >= 0)
        # the norm kernel's code on its tile: `rank` a runtime row length and (`one`, `zero`) the
        # heads and head stride of a 2-D input, as `rms_norm` passes them (the same masks and loads)
        x, mask, _ = load_rows(kv_ptr, rows, n_tokens, cols, rank, one, stride_kv, zero)
        y = normalize_rows(x, w_ptr, cols, rank, eps)
        dest_row = slot * stride_cache
        tl.store(cache_ptr + dest_row[:, None] + cols[None, :], y.to(cache_ptr.dtype.element_ty),
                 mask=mask & ok[:, None])
        pos = tl.load(pos_ptr + token, mask=ok, other=0).to(tl.int64)
        rotate_rows_into(kv_ptr + RANK, token * stride_kv, cache_ptr + RANK, dest_row, ok, pos, cos_ptr, sin_ptr,
                         stride_table, ROPE // 2, INTERLEAVED, "")


def latent_cache_write_reference(q_latent: torch.Tensor, q_pe: torch.Tensor, kv: torch.Tensor, positions: torch.Tensor,
                                 cos: torch.Tensor, sin: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                                 k_cache: torch.Tensor, slot_mapping: torch.Tensor,
                                 interleaved: bool = True) -> torch.Tensor:
    """The composition the kernel equals, the ops training runs: ``rms_norm`` of the latent,
    `apply_rotary` of the (de-interleaved) rope parts, the concatenations, ``kv_cache_write``."""
    rank = q_latent.shape[-1]
    latent, k_pe = kv.split([rank, kv.shape[-1] - rank], dim=-1)
    c = rms_norm(latent.contiguous(), norm_weight, eps)
    order = deinterleave if interleaved else (lambda x: x)
    q_rot = apply_rotary(order(q_pe), positions, cos, sin)
    k_rot = apply_rotary(order(k_pe.reshape(kv.shape[0], 1, -1)), positions, cos, sin)
    q = torch.cat([q_latent, q_rot], dim=-1)
    k = torch.cat([c.unsqueeze(1), k_rot], dim=-1)
    kv_cache_write(k, k[..., :rank], k_cache, k_cache[..., :rank], slot_mapping)
    return q


def _check(q_latent, q_pe, kv, positions, norm_weight, k_cache, slot_mapping) -> None:
    if q_latent.dim() != 3 or q_pe.dim() != 3 or kv.dim() != 2:
        raise ValueError(f"latent_cache_write: q_latent and q_pe must be [tokens, heads, dims] and kv [tokens, dims], "
                         f"got {tuple(q_latent.shape)}, {tuple(q_pe.shape)}, {tuple(kv.shape)}")
    tokens, heads, rank = q_latent.shape
    rope = q_pe.shape[-1]
    if q_pe.shape[:2] != (tokens, heads) or kv.shape[0] != tokens or positions.shape != (tokens,) \
            or slot_mapping.shape != (tokens,):
        raise ValueError(f"latent_cache_write: q_latent is {tuple(q_latent.shape)} but q_pe {tuple(q_pe.shape)}, kv "
                         f"{tuple(kv.shape)}, positions {tuple(positions.shape)}, slot_mapping "
                         f"{tuple(slot_mapping.shape)}")
    if kv.shape[1] != rank + rope or rope % 2:
        raise ValueError(f"latent_cache_write: kv has {kv.shape[1]} dims, not the latent's {rank} plus the query's "
                         f"{rope} rope dims (an even number)")
    if norm_weight.shape != (rank,):
        raise ValueError(f"latent_cache_write: norm_weight {tuple(norm_weight.shape)} must be ({rank},)")
    if k_cache.shape[-2:] != (1, rank + rope) or k_cache.dtype != kv.dtype:
        raise ValueError(f"latent_cache_write: the cache's rows {tuple(k_cache.shape[-2:])} ({k_cache.dtype}) must be "
                         f"(1, {rank + rope}) of kv's dtype {kv.dtype}")


def _fusable(q_latent, q_pe, kv, norm_weight, k_cache) -> bool:
    """Whether the kernel takes these inputs: no gradient wanted, the triton backend, power-of-two
    latent and rope dims, one dtype, unit last strides, a plain (not sharded) norm weight, and
    `kv` rows as aligned as the contiguous latent `rms_norm` reads in training (16-byte start,
    row stride a multiple of 16), so that the compiler vectorises the norm's loads, and lays out
    its tile, as it does there."""
    rank, rope = q_latent.shape[-1], q_pe.shape[-1]
    tensors = (q_latent, q_pe, kv, norm_weight)
    return (not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))
            and select("rotary", kv) == "triton" and select("rms_norm", kv) == "triton"
            and rank == next_power_of_2(rank) and rope >= 2 and rope == next_power_of_2(rope)
            and q_latent.dtype == q_pe.dtype == kv.dtype == norm_weight.dtype
            and all(t.stride(-1) == 1 for t in (q_latent, q_pe, kv, k_cache))
            and kv.data_ptr() % 16 == 0 and kv.stride(0) % 16 == 0
            and type(norm_weight) in (torch.Tensor, torch.nn.Parameter))


def latent_cache_write(q_latent: torch.Tensor, q_pe: torch.Tensor, kv: torch.Tensor, positions: torch.Tensor,
                       cos: torch.Tensor, sin: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                       k_cache: torch.Tensor, slot_mapping: torch.Tensor, interleaved: bool = True) -> torch.Tensor:
    """Assemble latent MLA's queries and write its keys into the latent cache.

    Args:
        q_latent: ``[tokens, heads, rank]`` absorbed no-rope queries (``q_nope @ W_uk``).
        q_pe: ``[tokens, heads, rope]`` the queries' rope dims, not yet rotated (a view is fine).
        kv: ``[tokens, rank + rope]`` ``kv_a_proj_with_mqa``'s output: the latent, then the
            key's rope dims, not yet normed or rotated.
        positions: ``[tokens]`` absolute positions into the ``[max_positions, rope / 2]`` fp32
            `cos`/`sin` tables of `rope_table`.
        norm_weight, eps: ``kv_a_layernorm``'s weight ``[rank]`` and epsilon.
        k_cache: the latent cache ``[..., 1, rank + rope]``; ``slot_mapping [tokens]`` gives each
            token's row (-1: not written), as in `kv_cache_write`.
        interleaved: the rope dims come in DeepSeek's interleaved pairs (``rope_interleave``).
    Returns:
        The queries ``[tokens, heads, rank + rope]``: the latent query, then the rotated rope
        query; each written row of the cache holds the normed latent, then the rotated rope key.
        Bitwise what `latent_cache_write_reference` gives.
    """
    _check(q_latent, q_pe, kv, positions, norm_weight, k_cache, slot_mapping)
    if not _fusable(q_latent, q_pe, kv, norm_weight, k_cache):
        return latent_cache_write_reference(q_latent, q_pe, kv, positions, cos, sin, norm_weight, eps, k_cache,
                                            slot_mapping, interleaved)
    require_triton("latent_cache_write")
    tokens, heads, rank = q_latent.shape
    rope = q_pe.shape[-1]
    q_out = torch.empty((tokens, heads, rank + rope), device=q_latent.device, dtype=q_latent.dtype)
    if tokens == 0:
        return q_out
    rows_view = k_cache.view(-1, rank + rope)
    _, rows, num_warps = norm_tile(rank)  # the norm kernel's tile, rows and warps: its layout
    grid = (triton.cdiv(tokens * heads, rows), 2)
    _latent_cache_write_kernel[grid](
        q_latent, q_pe, kv, norm_weight, positions, cos, sin, q_out, rows_view, slot_mapping,
        tokens, heads, q_latent.stride(0), q_latent.stride(1), q_pe.stride(0), q_pe.stride(1), kv.stride(0),
        q_out.stride(0), q_out.stride(1), rows_view.stride(0), cos.stride(0), eps, rank, 1, 0,
        RANK=rank, ROPE=rope, ROWS=rows, INTERLEAVED=interleaved, num_warps=num_warps, enable_fp_fusion=True,
        **dependent_launch_kwargs(q_latent.device))
    return q_out
