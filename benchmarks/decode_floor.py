"""What a rollout's decode steps must read at least: the bytes behind throughput.py's HBM roofline
and workload floor (and decode_profile.py's roofline), for every architecture the engine serves.

A decode step reads every weight but the input embedding, routed experts as many as its batch
reaches, each running sequence's KV cache in the layers that hold pages, and, for the
gated-DeltaNet hybrids (Qwen3.5, Qwen3-Next; docs/design.md section 6b), each sequence's state in
every GDN layer: the fp32 delta-rule state (``Hv x dk x dv``) and the conv state, each read and
written back (`runtime.linear_state_cache.LinearStateSpec`). The engine's own
accounting of a page (`runtime.llm_setup.cache_bytes_per_block`: the GDN layers hold none) is the
one used here. bench_utils re-exports these names for the scripts.
"""

from __future__ import annotations

import heapq

import torch


def kv_bytes_per_token(model, dtype: torch.dtype) -> int:
    """Bytes of one position's K and V over the layers that hold KV pages (the gated-DeltaNet
    layers of a hybrid hold none), as the engine allocates them."""
    from vexact_models.runtime.llm_setup import cache_bytes_per_block

    return cache_bytes_per_block(model, dtype, 1)


def linear_state_step_bytes(model, dtype: torch.dtype) -> float:
    """Bytes one decode step moves of one sequence's gated-DeltaNet state over all GDN layers: per
    layer the conv state (`dtype`) and the fp32 delta-rule state, each read and written back
    (docs/design.md section 6b); 0 for a model without GDN layers."""
    from vexact_models.runtime.linear_state_cache import linear_state_spec

    spec = linear_state_spec(model)
    if spec is None:
        return 0.0
    return 2 * spec.bytes_per_slot(dtype)


def decode_bytes(model, batch: int, mean_context: int) -> int:
    """Bytes one decode step must read at least: every weight but the input embedding (the tied
    LM head reads the embedding matrix) plus `batch` sequences' KV cache at `mean_context` tokens
    (`kv_bytes_per_token`) and, for a hybrid, their gated-DeltaNet state read and written
    (`linear_state_step_bytes`). MoE models count all experts (at batch >= 64 nearly every
    expert is routed to)."""
    param = next(model.parameters())
    itemsize = param.element_size()
    weights = sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n) * itemsize
    if model.config.tie_word_embeddings:
        weights += model.lm_head.weight.numel() * itemsize
    state = linear_state_step_bytes(model, param.dtype)
    return int(weights + batch * (mean_context * kv_bytes_per_token(model, param.dtype) + state))


def expected_routed(n_experts: int, top_k: int, rows: int) -> float:
    """Experts that `rows` tokens reach in expectation when each token routes to `top_k` distinct
    experts of `n_experts`, chosen uniformly (random router weights route about so)."""
    return n_experts * (1.0 - (1.0 - top_k / n_experts) ** rows)


def workload_state_bytes(model, prompt_lens: list[int], outputs: list[int]) -> float:
    """The gated-DeltaNet state bytes a workload's decode steps move (0 without GDN layers): each of
    a request's ``output - 1`` decode steps reads and writes its state (`linear_state_step_bytes`)."""
    dtype = next(model.parameters()).dtype
    steps = sum(max(0, out - 1) for out in outputs)
    return linear_state_step_bytes(model, dtype) * steps


def workload_decode_roofline(model, prompt_lens: list[int], outputs: list[int], max_seqs: int,
                             hbm_gbs: float) -> tuple[float, float]:
    """(weight seconds, cache seconds) that the decode steps of a rollout read at least, at
    `hbm_gbs` GB/s: requests start in order, at most `max_seqs` at a time (no preemption); a
    request's prompt step samples its first token, then each of its ``output - 1`` decode steps
    reads its cache up to the new token (and a hybrid's GDN state, `workload_state_bytes`). Every
    decode step reads the weights but the input embedding (`decode_bytes`), routed experts only as
    many as its batch reaches (`expected_routed`), and every running sequence's cache. Prompt steps
    are left out (bound by arithmetic), so this is a floor for the decode part of the run."""
    from vexact_models.experts import FusedExperts

    param = next(model.parameters())
    kv_per_token = kv_bytes_per_token(model, param.dtype)
    moe = [(m.num_experts, sum(p.numel() for p in m.parameters()) * param.element_size())
           for m in model.modules() if isinstance(m, FusedExperts)]
    top_k = getattr(model.config, "num_experts_per_tok", 1)
    dense = decode_bytes(model, 0, 0) - sum(nbytes for _, nbytes in moe)
    # A request's caches read the same tokens whenever it runs: contexts prompt + 1 .. prompt + output - 1.
    kv_tokens = sum((out - 1) * (prompt + 1) + (out - 1) * (out - 2) // 2
                    for prompt, out in zip(prompt_lens, outputs) if out > 1)
    # Only the batch of each step depends on the schedule: a request takes the first free slot.
    ends: list[int] = []  # heap of the steps at which running requests free their slot
    joins: dict[int, int] = {}  # step -> change in the running count
    for out in outputs:
        if out <= 1:
            continue
        start = heapq.heappop(ends) if len(ends) >= max_seqs else 0
        heapq.heappush(ends, start + out - 1)
        joins[start] = joins.get(start, 0) + 1
        joins[start + out - 1] = joins.get(start + out - 1, 0) - 1
    weight_bytes, batch, steps = 0.0, 0, sorted(joins)
    for step, following in zip(steps, steps[1:]):
        batch += joins[step]
        if batch:
            per_step = dense + sum(nbytes * expected_routed(n, top_k, batch) / n for n, nbytes in moe)
            weight_bytes += (following - step) * per_step
    cache_bytes = kv_tokens * kv_per_token + workload_state_bytes(model, prompt_lens, outputs)
    return weight_bytes / (hbm_gbs * 1e9), cache_bytes / (hbm_gbs * 1e9)
