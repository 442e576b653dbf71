"""Building blocks of an exactly on-policy GRPO loop on vexact-models.

    outs = llm.generate(prompts, SamplingParams(n=group_size, temperature=T, max_tokens=K))
    batch = RolloutBatch.from_outputs(outs)                       # ids, masks, rollout logprobs
    rewards = torch.tensor([repeat_last_token_reward(p, c) for p, c in batch.pairs()])
    advantages = group_advantages(rewards, group_size)
    logprobs = model.token_logprobs(batch.input_ids, batch.attention_mask, temperature=T)
    loss = clipped_policy_loss(logprobs, batch.rollout_logprobs, advantages, batch.completion_mask)

Because `model.token_logprobs` equals the rollout's logprobs bitwise, the rollout logprobs are the
"old" policy's logprobs of PPO/GRPO as they are: no recompute pass, an importance ratio of exactly
1 on the first update, and `mismatch_stats` reads 0. `examples/grpo.py` is the full loop.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

__all__ = ["RolloutBatch", "clipped_policy_loss", "entropy_rows", "group_advantages", "k3_kl", "mismatch_stats",
           "random_prompts", "repeat_last_token_reward"]

#: fp32 logits held at once by `entropy_rows`
ENTROPY_CHUNK_BYTES = 256 << 20


@dataclass
class RolloutBatch:
    """Rollout samples as right-padded training tensors, one row per sample.

    Attributes:
        input_ids: ``[B, S]`` prompt + completion token ids, right-padded with ``pad_token_id``.
        attention_mask: ``[B, S]`` 1 on real tokens.
        completion_mask: ``[B, S]`` 1 on completion tokens (the ones the policy sampled).
        rollout_logprobs: ``[B, S]`` fp32, the logprob the rollout reported for each completion
            token, 0 elsewhere; aligned with ``input_ids`` like ``token_logprobs``' output.
        prompt_index: ``[B]`` index of the prompt (request) each row was sampled for.
        prompt_lens: ``[B]`` prompt length of each row.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    completion_mask: torch.Tensor
    rollout_logprobs: torch.Tensor
    prompt_index: torch.Tensor
    prompt_lens: torch.Tensor

    @classmethod
    def from_outputs(cls, outputs: Sequence, pad_token_id: int = 0) -> "RolloutBatch":
        """Pack `LLM.generate` outputs (``RequestOutput``s; every completion of every request,
        in order) into tensors. A completion with no tokens is a ValueError."""
        rows, lps, prompt_index, prompt_lens = [], [], [], []
        for i, out in enumerate(outputs):
            for comp in out.outputs:
                if not comp.token_ids:
                    raise ValueError(f"RolloutBatch.from_outputs: request {i} has a completion with no tokens")
                rows.append(list(out.prompt_token_ids) + list(comp.token_ids))
                lps.append(comp.logprobs)
                prompt_index.append(i)
                prompt_lens.append(len(out.prompt_token_ids))
        if not rows:
            raise ValueError("RolloutBatch.from_outputs: no completions")
        width = max(len(r) for r in rows)
        input_ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
        completion_mask = torch.zeros((len(rows), width), dtype=torch.long)
        rollout_logprobs = torch.zeros((len(rows), width), dtype=torch.float32)
        for b, (row, lp, p) in enumerate(zip(rows, lps, prompt_lens)):
            input_ids[b, :len(row)] = torch.tensor(row)
            attention_mask[b, :len(row)] = 1
            completion_mask[b, p:len(row)] = 1
            # the rollout reports fp32 values as Python floats: converting back is exact
            rollout_logprobs[b, p:len(row)] = torch.tensor(lp, dtype=torch.float32)
        return cls(input_ids, attention_mask, completion_mask, rollout_logprobs, torch.tensor(prompt_index),
                   torch.tensor(prompt_lens))

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def to(self, device: torch.device | str) -> "RolloutBatch":
        """A copy with every tensor on `device`."""
        return RolloutBatch(*(t.to(device) for t in self._tensors()))

    def rows(self, index: torch.Tensor | slice) -> "RolloutBatch":
        """The samples at `index` (e.g. a micro-batch)."""
        return RolloutBatch(*(t[index] for t in self._tensors()))

    def micro_batches(self, size: int) -> Iterator["RolloutBatch"]:
        """Consecutive slices of at most `size` samples."""
        if size < 1:
            raise ValueError(f"RolloutBatch.micro_batches: size={size} must be >= 1")
        for start in range(0, len(self), size):
            yield self.rows(slice(start, start + size))

    def pairs(self) -> Iterator[tuple[list[int], list[int]]]:
        """``(prompt ids, completion ids)`` of every sample, as lists."""
        for ids, mask, p in zip(self.input_ids.tolist(), self.attention_mask.tolist(), self.prompt_lens.tolist()):
            n = sum(mask)
            yield ids[:p], ids[p:n]

    def _tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.input_ids, self.attention_mask, self.completion_mask, self.rollout_logprobs, self.prompt_index,
                self.prompt_lens)


def group_advantages(rewards: torch.Tensor, group_size: int, scale: bool = True, eps: float = 1e-4) -> torch.Tensor:
    """GRPO advantages: each reward minus the mean of its group (``group_size`` consecutive
    samples of one prompt), divided by the group's standard deviation + `eps` when `scale`
    (Dr. GRPO: ``scale=False``). Returns ``[B]`` like `rewards`."""
    rewards = torch.as_tensor(rewards, dtype=torch.float32)
    if group_size < 1 or rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"group_advantages: rewards of shape {tuple(rewards.shape)} do not split into groups of "
                         f"group_size={group_size}")
    groups = rewards.view(-1, group_size)
    centred = groups - groups.mean(dim=1, keepdim=True)
    if scale and group_size > 1:
        centred = centred / (groups.std(dim=1, keepdim=True) + eps)
    return centred.reshape(-1)


def clipped_policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                        mask: torch.Tensor, clip_low: float = 0.2, clip_high: float = 0.2,
                        num_tokens: int | None = None) -> torch.Tensor:
    """PPO/GRPO clipped surrogate, summed over masked tokens and divided by `num_tokens`
    (default: the masked token count; pass the whole batch's count when `logprobs` is one
    micro-batch of it, so that micro-batch losses add up to the batch loss).

    ``ratio = exp(logprobs - old_logprobs)``, loss per token ``-min(ratio * A, clip(ratio, 1 -
    clip_low, 1 + clip_high) * A)``; `advantages` is ``[B]`` (one per sequence) or ``[B, S]``.
    """
    if logprobs.shape != old_logprobs.shape or logprobs.shape != mask.shape:
        raise ValueError(f"clipped_policy_loss: logprobs {tuple(logprobs.shape)}, old_logprobs "
                         f"{tuple(old_logprobs.shape)} and mask {tuple(mask.shape)} must have one shape")
    if not (0 <= clip_low < 1 and clip_high >= 0):
        raise ValueError(f"clipped_policy_loss: clip_low={clip_low} must be in [0, 1) and clip_high={clip_high} >= 0")
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    # padding gets ratio 1 whatever it holds (no inf * 0 = NaN) and is masked out below
    ratio = torch.exp(torch.where(mask.bool(), logprobs - old_logprobs, 0.0))
    mask = mask.to(logprobs.dtype)
    per_token = -torch.min(ratio * advantages, ratio.clamp(1 - clip_low, 1 + clip_high) * advantages)
    denominator = mask.sum() if num_tokens is None else num_tokens
    return (per_token * mask).sum() / max(float(denominator), 1.0)


def k3_kl(logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, mask: torch.Tensor) -> float:
    """Schulman's k3 estimate of KL(sampler || policy) over the masked tokens, which were drawn
    from the sampler: mean of ``r - 1 - log r`` with ``log r = logprobs - sampler_logprobs``.
    Non-negative; exactly 0 when the two logprobs are equal."""
    log_r = (logprobs.detach() - sampler_logprobs)[mask.bool()].double()
    if log_r.numel() == 0:
        return 0.0
    return float((torch.expm1(log_r) - log_r).mean())


def mismatch_stats(logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """How far training logprobs are from the rollout's on the masked (sampled) tokens:
    ``max_abs_delta``, ``mean_abs_delta``, ``k3_kl`` (see `k3_kl`), ``mismatched_tokens`` (tokens
    whose two fp32 values differ in any bit) and ``tokens``."""
    sel = mask.bool()
    ours, theirs = logprobs.detach()[sel].float(), rollout_logprobs[sel].float()
    delta = (ours - theirs).abs()
    differ = ours.view(torch.int32) != theirs.view(torch.int32)  # bitwise, so -0.0 vs 0.0 or NaNs count too
    return {"max_abs_delta": float(delta.max()) if delta.numel() else 0.0,
            "mean_abs_delta": float(delta.mean()) if delta.numel() else 0.0,
            "k3_kl": k3_kl(logprobs, rollout_logprobs, mask),
            "mismatched_tokens": int(differ.sum()), "tokens": int(sel.sum())}


def _entropy_of(hidden: torch.Tensor, weight: torch.Tensor, temperature: float, softcap: float | None) -> torch.Tensor:
    from vexact_models.kernels import lm_head_logits

    logp = torch.log_softmax(lm_head_logits(hidden, weight, softcap) / temperature, dim=-1)
    return -(logp.exp() * logp).sum(-1)


def entropy_rows(hidden: torch.Tensor, weight: torch.Tensor, temperature: float = 1.0,
                 softcap: float | None = None) -> torch.Tensor:
    """Entropy ``[rows]`` (fp32) of ``softmax(lm_head_logits(hidden, weight, softcap) / T)`` for
    final hidden states ``[rows, hidden]`` and an LM head ``[vocab, hidden]`` (`softcap`: the
    model's final logit soft cap, `causal_lm.final_logit_softcap`), a chunk of rows at a time;
    with autograd on, each chunk's logits are recomputed in the backward instead of kept. A metric
    and a regulariser: it makes no bitwise promise."""
    if not temperature > 0:
        raise ValueError(f"entropy_rows: temperature={temperature} must be > 0")
    chunk = max(1, ENTROPY_CHUNK_BYTES // (4 * weight.shape[0]))
    pieces = []
    for part in hidden.split(chunk):
        if torch.is_grad_enabled() and (part.requires_grad or weight.requires_grad):
            pieces.append(torch.utils.checkpoint.checkpoint(_entropy_of, part, weight, temperature, softcap,
                                                            use_reentrant=False))
        else:
            pieces.append(_entropy_of(part, weight, temperature, softcap))
    return torch.cat(pieces) if pieces else hidden.new_zeros(0, dtype=torch.float32)


def random_prompts(num: int, vocab: Sequence[int] | range, min_len: int, max_len: int,
                   rng: random.Random) -> list[list[int]]:
    """`num` prompts of uniformly random length in [min_len, max_len], tokens drawn from `vocab`."""
    if not 1 <= min_len <= max_len:
        raise ValueError(f"random_prompts: need 1 <= min_len <= max_len, got min_len={min_len}, max_len={max_len}")
    if len(vocab) == 0:
        raise ValueError("random_prompts: vocab is empty")
    return [[rng.choice(vocab) for _ in range(rng.randint(min_len, max_len))] for _ in range(num)]


def repeat_last_token_reward(prompt_ids: Sequence[int], completion_ids: Sequence[int]) -> float:
    """The toy verifiable task of the examples: the fraction of completion tokens that repeat the
    prompt's last token (1.0: the whole completion does)."""
    if not prompt_ids or not completion_ids:
        return 0.0
    target = prompt_ids[-1]
    return sum(t == target for t in completion_ids) / len(completion_ids)
