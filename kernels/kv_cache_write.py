"""kv_cache_write: scatter new K/V rows into the paged caches by slot.

``k_cache.view(-1, Hkv, D)[slot_mapping[t]] = k[t]`` (and the same for V); a slot of -1 skips
the token. The caches then hold exactly the bf16 K/V tensors the training pass uses (docs/design.md
rule 6): this is a copy, no arithmetic.
"""

from __future__ import annotations

import torch

from ._triton import next_power_of_2, require_triton, tl, triton
from .backend import select
from .dependent_launch import dependent_launch_kwargs, wait_for_inputs


@triton.jit
def _kv_cache_write_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                           stride_kt, stride_vt, stride_kc, stride_vc,
                           K_WIDTH: tl.constexpr, V_WIDTH: tl.constexpr,
                           BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, PDL: tl.constexpr = False):
    wait_for_inputs(PDL)
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return
    ok = tl.arange(0, BLOCK_K)
    tl.store(k_cache_ptr + slot * stride_kc + ok, tl.load(k_ptr + token * stride_kt + ok, mask=ok < K_WIDTH), mask=ok < K_WIDTH)
    ov = tl.arange(0, BLOCK_V)
    tl.store(v_cache_ptr + slot * stride_vc + ov, tl.load(v_ptr + token * stride_vt + ov, mask=ov < V_WIDTH), mask=ov < V_WIDTH)


def check_cache_rows(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, op: str) -> None:
    """A ValueError naming `op` unless `k`/`v` rows ``[T, Hkv, D]`` have the caches' last two dims
    and dtypes (shared by the ops that write the cache)."""
    if k.shape[1:] != k_cache.shape[-2:] or v.shape[1:] != v_cache.shape[-2:]:
        raise ValueError(f"{op}: k {tuple(k.shape[1:])}/v {tuple(v.shape[1:])} do not match cache rows "
                         f"{tuple(k_cache.shape[-2:])}/{tuple(v_cache.shape[-2:])}")
    if k.dtype != k_cache.dtype or v.dtype != v_cache.dtype:
        raise ValueError(f"{op}: dtypes {k.dtype}/{v.dtype} must match the caches' {k_cache.dtype}/{v_cache.dtype}")


def kv_cache_write(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """Write `k` ``[T, Hkv, D]`` and `v` ``[T, Hkv, Dv]`` into the caches (``[pages, page_size,
    Hkv, D]`` or any shape whose last two dims are ``Hkv, D``) at ``slot_mapping`` ``[T]``
    (int, -1 = skip). In place; slots must be distinct."""
    if k.shape[0] != slot_mapping.shape[0] or v.shape[0] != slot_mapping.shape[0]:
        raise ValueError(f"kv_cache_write: {k.shape[0]} keys, {v.shape[0]} values, {slot_mapping.shape[0]} slots")
    check_cache_rows(k, v, k_cache, v_cache, "kv_cache_write")
    k_rows = k_cache.view(-1, k_cache.shape[-2] * k_cache.shape[-1])
    v_rows = v_cache.view(-1, v_cache.shape[-2] * v_cache.shape[-1])
    k2, v2 = k.reshape(k.shape[0], -1), v.reshape(v.shape[0], -1)
    if select("kv_cache_write", k) == "triton":
        require_triton("kv_cache_write")
        if k.shape[0] == 0:
            return
        k2 = k2 if k2.stride(-1) == 1 else k2.contiguous()
        v2 = v2 if v2.stride(-1) == 1 else v2.contiguous()
        _kv_cache_write_kernel[(k.shape[0],)](
            k2, v2, k_rows, v_rows, slot_mapping, k2.stride(0), v2.stride(0), k_rows.stride(0), v_rows.stride(0),
            K_WIDTH=k2.shape[1], V_WIDTH=v2.shape[1],
            BLOCK_K=next_power_of_2(k2.shape[1]), BLOCK_V=next_power_of_2(v2.shape[1]), num_warps=4,
            **dependent_launch_kwargs(k.device), enable_fp_fusion=True)
        return
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_rows[slots] = k2[keep]
    v_rows[slots] = v2[keep]
