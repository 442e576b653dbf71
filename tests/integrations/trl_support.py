"""What the TRL integration's test files share: TRL's mismatch metrics' names, a
`VexactGRPOTrainer` on a tiny random checkpoint loaded from its path, and TRL's padded layout of a
rollout."""

import torch
from trl import GRPOConfig

from vexact_models.integrations.trl import VexactGRPOTrainer

DIFF_MAX = "sampling/sampling_logp_difference/max"
DIFF_MEAN = "sampling/sampling_logp_difference/mean"
IS_MIN, IS_MEAN, IS_MAX = (f"sampling/importance_sampling_ratio/{k}" for k in ("min", "mean", "max"))


def grpo_trainer(example, arch_name: str, tmp_path, beta: float = 0.0, peft_config=None, gradient_checkpointing=False,
             multimodal: bool = False, grpo: dict | None = None, **config_overrides):
    """A VexactGRPOTrainer on a tiny random checkpoint of `arch_name`, loaded from its path (a
    published-style multimodal checkpoint with `multimodal`: tests/models/model_support.py)."""
    from vexact_models.registry import get

    from ..models.model_support import save_multimodal

    arch = get(arch_name)
    config = arch.tiny_config(vocab_size=16, **config_overrides)
    torch.manual_seed(0)
    if multimodal:
        save_multimodal(arch, config, tmp_path / "ckpt")
    else:
        arch.causal_lm_class(config).save_pretrained(tmp_path / "ckpt")
    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4, max_completion_length=5,
                      max_steps=2, logging_steps=1, save_strategy="no", learning_rate=1e-2, report_to=[], use_cpu=True,
                      bf16=False, gradient_checkpointing=gradient_checkpointing, disable_tqdm=True, beta=beta,
                      **(grpo or {}))
    return VexactGRPOTrainer(str(tmp_path / "ckpt"), reward_funcs=example.repeat_last_token, args=args,
                             processing_class=example.toy_tokenizer(config), llm_kwargs={"kv_cache_bytes": 16 << 20},
                             train_dataset=example.toy_dataset(example.parse_args(["--steps", "1"]), 16),
                             peft_config=peft_config)


def trl_layout(prompt_ids, completion_ids, rollout_lps):
    """TRL's padded batch: left-padded prompts, right-padded completions; the rollout logprobs
    and the completion mask in the completion's columns."""
    width_p, width_c = max(map(len, prompt_ids)), max(map(len, completion_ids))
    ids = torch.zeros(len(prompt_ids), width_p + width_c, dtype=torch.long)
    mask = torch.zeros_like(ids)
    expected = torch.zeros(len(prompt_ids), width_c)
    cmask = torch.zeros(len(prompt_ids), width_c, dtype=torch.bool)
    for r, (p, c, lp) in enumerate(zip(prompt_ids, completion_ids, rollout_lps)):
        ids[r, width_p - len(p):width_p], mask[r, width_p - len(p):width_p] = torch.tensor(p), 1
        ids[r, width_p:width_p + len(c)], mask[r, width_p:width_p + len(c)] = torch.tensor(c), 1
        expected[r, :len(c)], cmask[r, :len(c)] = torch.tensor(lp), True
    return ids, mask, expected, cmask
