"""MLA's latent KV cache mode (``config.mla_kv_cache = "latent"``; docs/mla-kv-cache.md).

The cache holds, per token and layer, one key row: the normalised latent ``c`` (``kv_lora_rank``
dims) followed by the rotated rope key (``qk_rope_head_dim``), 576 values at the real shapes; the
value is a view of the key's first ``kv_lora_rank`` dims, never a second copy. ``kv_b_proj`` is
absorbed (DeepSeek's inference form): ``W_uk[h]`` turns head h's no-rope query into a latent
query, attention runs MQA-style over ``[c, k_rope]`` with value ``c``, and ``W_uv[h]`` turns the
head's latent output into its value dims before ``o_proj``. Training runs exactly this (the same
kernels in the same order over the packed tensors), so rollout logprobs stay bitwise equal to
training logprobs (docs/design.md rule 6: the cache holds what training attends over). The
absorption GEMMs are `kernels.head_linear` (batch-invariant, rule 1) on strided views of
``kv_b_proj.weight``.

Absorption is exact algebra, so HF parity holds to fp32 rounding; the summation order differs
from the expanded form, so the two modes give different low-order bits (each mode is bitwise
consistent with itself). The mode is a pure compute choice over the same parameters: it can be
set at load time (``from_pretrained(..., mla_kv_cache="latent")``), in the config (saved with
it), or switched on a built model (`set_mla_kv_cache`), but not under a rollout engine that
already allocated its cache for the other mode (a named error).
"""

from __future__ import annotations

import torch
from torch import nn

from vexact_models.adapters import base_layer, lora_terms
from vexact_models.kernels import head_linear, latent_cache_write, linear
from vexact_models.layers import plain_rms_norm

MLA_KV_CACHE_MODES = ("expanded", "latent")
DEFAULT_MLA_KV_CACHE = "latent"  # measured on the H200: docs/mla-kv-cache.md "Choosing a mode"


def check_mla_kv_cache(mode: object, where: str = "mla_kv_cache") -> str:
    """`mode` if it is one of `MLA_KV_CACHE_MODES`, else a ValueError naming it."""
    if not isinstance(mode, str) or mode not in MLA_KV_CACHE_MODES:
        raise ValueError(f"{where}={mode!r} is not an MLA KV cache mode; choose one of {MLA_KV_CACHE_MODES}")
    return mode


def mla_kv_cache_mode(config) -> str:
    """The config's ``mla_kv_cache`` (a field stock transformers ignores), default
    `DEFAULT_MLA_KV_CACHE`."""
    return check_mla_kv_cache(getattr(config, "mla_kv_cache", None) or DEFAULT_MLA_KV_CACHE, "config.mla_kv_cache")


class KVCacheSpec(tuple):
    """``(layers, KV heads, key dim, value dim)`` as every ``kv_cache_spec`` returns, plus
    ``value_in_key``: the value is a view of the key's first ``value dim`` dims, so the runtime
    allocates (and counts) the key cache only (`runtime.model_runner`)."""

    def __new__(cls, layers: int, kv_heads: int, head_dim_k: int, head_dim_v: int, value_in_key: bool = False):
        spec = super().__new__(cls, (layers, kv_heads, head_dim_k, head_dim_v))
        spec.value_in_key = value_in_key
        return spec

    def __reduce__(self):  # pickling keeps the flag
        return (KVCacheSpec, (*self, self.value_in_key))


def kv_b_weight(kv_b_proj: nn.Module, where: str) -> torch.Tensor:
    """``kv_b_proj``'s effective weight ``[H * (nope + v), kv_lora_rank]``: the base weight, plus
    each active PEFT LoRA adapter's ``scaling * B @ A`` (computed with `kernels.linear`, the same
    on both paths). What cannot be absorbed into a weight is a ValueError naming the module."""
    base = base_layer(kv_b_proj)
    if base.bias is not None:
        raise ValueError(f"{where}: mla_kv_cache='latent' absorbs kv_b_proj, which must have no bias")
    weight = base.weight
    for term in lora_terms(kv_b_proj, where):
        if term.lora_b.bias is not None:
            raise ValueError(f"{where}: a LoRA bias on kv_b_proj cannot be absorbed (mla_kv_cache='latent'); "
                             "use lora_bias=False, or mla_kv_cache='expanded'")
        dropout = term.dropout
        if dropout.training and not isinstance(dropout, nn.Identity) and getattr(dropout, "p", 0.0) > 0:
            raise ValueError(f"{where}: LoRA dropout on kv_b_proj cannot be absorbed (mla_kv_cache='latent'); "
                             "set lora_dropout=0, compute in eval mode, or use mla_kv_cache='expanded'")
        delta = linear(term.lora_b.weight, term.lora_a.weight.t())  # B @ A
        weight = weight + (delta * term.scaling).to(weight.dtype)
    return weight


def absorbed_weights(attn: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """``(W_uk^T [H, kv_lora_rank, nope], W_uv [H, v, kv_lora_rank])``: strided views of
    ``kv_b_proj``'s (effective) weight in `kernels.head_linear`'s ``[H, N, K]`` layout."""
    where = f"model.layers.{attn.layer_idx}.self_attn.kv_b_proj"
    weight = kv_b_weight(attn.kv_b_proj, where).view(attn.num_heads, attn.nope_dim + attn.v_dim, attn.kv_lora_rank)
    return weight[:, :attn.nope_dim].transpose(1, 2), weight[:, attn.nope_dim:]


def _check_cache(context, layer_idx: int, key_dim: int, value_in_key: bool) -> None:
    """A paged context's cache must be the one this mode writes (the engine allocated it from
    ``kv_cache_spec`` before the mode changed otherwise)."""
    caches = getattr(context, "kv_caches", None)
    if caches is None:  # training: the packed tensors are the cache
        return
    k_cache, v_cache = caches[layer_idx]
    if k_cache.shape[-1] != key_dim or (v_cache.data_ptr() == k_cache.data_ptr()) != value_in_key:
        mode = "latent" if value_in_key else "expanded"
        raise ValueError(f"DeepseekV3Attention (layer {layer_idx}): mla_kv_cache={mode!r} but the engine's KV cache "
                         f"holds key rows of {k_cache.shape[-1]} dims allocated for the other mode; set the mode "
                         "before creating the LLM (or create a new one)")


def latent_attention(attn: nn.Module, q: torch.Tensor, compressed: torch.Tensor, positions: torch.Tensor,
                     rope: tuple[torch.Tensor, torch.Tensor], context) -> torch.Tensor:
    """Absorbed MLA for the queries ``q [T, H, nope + rope]`` and ``kv_a_proj_with_mqa``'s output
    ``compressed [T, kv_lora_rank + rope]``: ``[T, H, v]`` (the per-head values before ``o_proj``).

    Training (and any context without a cache) runs the ops one by one: the latent's norm and
    the rope rotations (`attn.normed_and_rotated`), then `absorbed_attention`. A rollout's paged
    context does the same in one launch that also writes the cache (`kernels.latent_cache_write`,
    bitwise those ops) where ``kv_a_layernorm`` is a plain RMSNorm (no hooks, no override: those
    run as module calls)."""
    caches, norm = getattr(context, "kv_caches", None), attn.kv_a_layernorm
    if caches is None or not plain_rms_norm(norm):
        q_rot, c, k_rot = attn.normed_and_rotated(q, compressed, positions, rope)
        return absorbed_attention(attn, q[..., :attn.nope_dim], q_rot, c, k_rot, context)
    _check_cache(context, attn.layer_idx, attn.kv_lora_rank + attn.rope_dim, True)
    w_uk_t, w_uv = absorbed_weights(attn)
    cos, sin = rope
    q = latent_cache_write(head_linear(q[..., :attn.nope_dim], w_uk_t), q[..., attn.nope_dim:], compressed, positions,
                           cos, sin, norm.weight, norm.variance_epsilon, caches[attn.layer_idx][0], context.slot_mapping,
                           attn.interleaved)
    return head_linear(context.attend_cache(attn.layer_idx, q, attn.scaling), w_uv)


def absorbed_attention(attn: nn.Module, q_nope: torch.Tensor, q_rot: torch.Tensor, c: torch.Tensor,
                       k_rot: torch.Tensor, context) -> torch.Tensor:
    """Absorbed MLA for ``q_nope [T, H, nope]``, ``q_rot [T, H, rope]``, the normalised latent
    ``c [T, kv_lora_rank]`` and the rotated rope key ``k_rot [T, 1, rope]``: ``[T, H, v]`` (the
    per-head values before ``o_proj``)."""
    rank = attn.kv_lora_rank
    _check_cache(context, attn.layer_idx, rank + attn.rope_dim, True)
    w_uk_t, w_uv = absorbed_weights(attn)
    q = torch.cat([head_linear(q_nope, w_uk_t), q_rot], dim=-1)  # [T, H, rank + rope]
    k = torch.cat([c.unsqueeze(1), k_rot], dim=-1)  # [T, 1, rank + rope]: one key head for all heads
    out = context.attend(attn.layer_idx, q, k, k[..., :rank], attn.scaling)  # the value is c, a view of k
    return head_linear(out, w_uv)


def expanded_cache_check(context, attn: nn.Module) -> None:
    """The expanded mode's counterpart of the latent mode's cache check."""
    _check_cache(context, attn.layer_idx, attn.qk_head_dim, False)
