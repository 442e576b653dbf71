"""The gated delta rule's chunked backward in torch: the analytic gradients the Triton backward
computes (`gated_delta_backward_triton`), chunk by chunk, for its tests (docs/design.md rule 8,
section 6b "Backward").

A chunk's forward (`gated_delta_reference.chunk_forward`, steps 1-6 there) maps its boundary
state ``S`` and its rows to the outputs ``o`` and the next state ``S'``. Its backward takes
``dO`` and ``dS'`` (the gradient of ``S'``) and splits in two:

- `state_grad_step`: ``dS = (q exp(G))^T dO + exp(G_last) dS' - w^T dv_new`` with
  ``dv_new = P^T dO + K_d dS'`` (``P = lower(q k^T * exp(G_i - G_j))``,
  ``K_d = k exp(G_last - G)``). It reads neither ``S`` nor ``v``, so the reverse recurrence
  over a sequence's chunks runs on the keys, gates, betas, queries and ``dO`` alone;
- `chunk_grads`: given ``S`` (the forward's boundary state) and ``dS'``, the gradients of the
  chunk's ``q, k, v, g, beta``: through ``v_new = T (v beta) - w S``, the solve
  (``dL = -T^T dT T^T``, strictly lower), the pair decays (``dG_i += sum_j H_ij``,
  ``dG_j -= sum_i H_ij``, ``H = dL * L + dP * P``), ``exp(G)`` scalings, the prefix sum (a
  reverse prefix sum of ``dG``) and the l2 norms (``dx = (dy - y (y . dy)) / |x|``).

Everything here is plain torch in the inputs' dtype (float64 in the tests, where it equals
autograd through `gated_delta_reference.AUTOGRAD` to rounding).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import gated_delta_reference as ref


@dataclass(frozen=True)
class ChunkKeys:
    """What a chunk's queries, keys, gates and betas give its backward (``[.., C, ...]``)."""

    q: torch.Tensor  # normalised, scaled queries
    k: torch.Tensor  # normalised keys
    cum: torch.Tensor  # G, prefix sums of g
    decay: torch.Tensor  # exp(G_i - G_j), j <= i
    lmat: torch.Tensor  # L, strictly lower
    t: torch.Tensor  # (I + L)^-1
    w: torch.Tensor  # T (k beta exp(G))
    p: torch.Tensor  # lower(q k^T * decay)


def _t(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(-1, -2)


def chunk_keys(q: torch.Tensor, k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *, scale: float,
               use_qk_l2norm: bool) -> ChunkKeys:
    """`ChunkKeys` of chunks ``q, k [.., C, dk]``, ``g, beta [.., C]`` (absent rows exact zeros)."""
    ops = ref.AUTOGRAD
    c = k.shape[-2]
    zero = torch.zeros((), dtype=k.dtype, device=k.device)
    kn = ref.l2norm(k, ops) if use_qk_l2norm else k
    qn = (ref.l2norm(q, ops) if use_qk_l2norm else q) * scale
    cum = g.cumsum(-1)
    lower = ref.lower_mask(c, k.device, strict=False)
    decay = ref.pair_decay(cum, lower, ops)
    lmat = torch.where(ref.lower_mask(c, k.device, strict=True), (kn * beta.unsqueeze(-1)) @ _t(kn) * decay, zero)
    t = ops.solve(lmat)
    w = t @ (kn * (beta * cum.exp()).unsqueeze(-1))
    p = torch.where(lower, qn @ _t(kn) * decay, zero)
    return ChunkKeys(qn, kn, cum, decay, lmat, t, w, p)


def _last_decays(keys: ChunkKeys) -> tuple[torch.Tensor, torch.Tensor]:
    """``exp(G_last) [.., 1]`` and ``exp(G_last - G) [.., C]``."""
    last = keys.cum[..., -1:]
    return last.exp(), (last - keys.cum).exp()


def state_grad_step(keys: ChunkKeys, d_out: torch.Tensor, d_end: torch.Tensor) -> torch.Tensor:
    """The gradient of a chunk's boundary state from ``dO [.., C, dv]`` and ``dS' [.., dk, dv]``."""
    exp_last, exp_tail = _last_decays(keys)
    d_new = _t(keys.p) @ d_out + (keys.k * exp_tail.unsqueeze(-1)) @ d_end
    q_decayed = keys.q * keys.cum.exp().unsqueeze(-1)
    return _t(q_decayed) @ d_out + exp_last.unsqueeze(-1) * d_end - _t(keys.w) @ d_new


def l2norm_backward(x: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    """The gradient of ``x`` through ``y = x / sqrt(sum(x * x) + eps)`` (over the last dim)."""
    norm = torch.sqrt((x * x).sum(-1, keepdim=True) + ref.L2NORM_EPS)
    y = x / norm
    return (dy - y * (y * dy).sum(-1, keepdim=True)) / norm


def reverse_prefix_sum(x: torch.Tensor) -> torch.Tensor:
    """``out[.., j] = sum_{i >= j} x[.., i]``: the backward of a prefix sum."""
    return x.flip(-1).cumsum(-1).flip(-1)


def chunk_grads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                state: torch.Tensor, d_out: torch.Tensor, d_end: torch.Tensor, *, scale: float,
                use_qk_l2norm: bool) -> tuple[torch.Tensor, ...]:
    """``dq, dk [.., C, dk]``, ``dv [.., C, dv]``, ``dg, dbeta [.., C]`` of chunks whose boundary
    state is ``state [.., dk, dv]``, from ``dO [.., C, dv]`` and ``dS' [.., dk, dv]`` (the module
    docstring's formulas; q, k raw, at the value heads)."""
    c = k.shape[-2]
    zero = torch.zeros((), dtype=k.dtype, device=k.device)
    keys = chunk_keys(q, k, g, beta, scale=scale, use_qk_l2norm=use_qk_l2norm)
    exp_last, exp_tail = _last_decays(keys)
    exp_cum = keys.cum.exp().unsqueeze(-1)
    k_tail = keys.k * exp_tail.unsqueeze(-1)
    k_beta = keys.k * beta.unsqueeze(-1)
    v_beta = v * beta.unsqueeze(-1)
    v_new = keys.t @ v_beta - keys.w @ state
    d_new = _t(keys.p) @ d_out + k_tail @ d_end
    d_q_decayed = d_out @ _t(state)
    d_p = torch.where(ref.lower_mask(c, k.device, strict=False), d_out @ _t(v_new), zero)
    d_tail = v_new @ _t(d_end)
    d_w = -(d_new @ _t(state))
    d_tmat = d_new @ _t(v_beta) + d_w @ _t(k_beta * exp_cum)
    d_v_beta = _t(keys.t) @ d_new
    d_l = torch.where(ref.lower_mask(c, k.device, strict=True), -(_t(keys.t) @ d_tmat @ _t(keys.t)), zero)
    m_l, m_p = d_l * keys.decay, d_p * keys.decay
    d_k_beta = m_l @ keys.k + (_t(keys.t) @ d_w) * exp_cum  # through L and through w's k beta exp(G)
    d_qn = m_p @ keys.k + d_q_decayed * exp_cum
    d_kn = _t(m_l) @ k_beta + _t(m_p) @ keys.q + d_k_beta * beta.unsqueeze(-1) + d_tail * exp_tail.unsqueeze(-1)
    d_beta = (d_k_beta * keys.k).sum(-1) + (d_v_beta * v).sum(-1)
    h = d_l * keys.lmat + d_p * keys.p
    d_cum = (h.sum(-1) - h.sum(-2) + (d_q_decayed * keys.q * exp_cum).sum(-1)
             + ((_t(keys.t) @ d_w) * k_beta * exp_cum).sum(-1) - (d_tail * k_tail).sum(-1))
    d_last = (d_tail * k_tail).sum((-1, -2)) + exp_last[..., 0] * (d_end * state).sum((-1, -2))
    d_cum = torch.cat([d_cum[..., :-1], d_cum[..., -1:] + d_last.unsqueeze(-1)], dim=-1)
    d_q = d_qn * scale
    if use_qk_l2norm:
        d_q, d_k = l2norm_backward(q, d_q), l2norm_backward(k, d_kn)
    else:
        d_k = d_kn
    return d_q, d_k, d_v_beta * beta.unsqueeze(-1), reverse_prefix_sum(d_cum), d_beta
