"""GRPO with zero training-inference mismatch, on vexact-models' public API only.

    vexact_models.patch() -> AutoModelForCausalLM.from_pretrained(...) -> LLM(model)   (shared weights)
    every step: n samples per prompt -> verifiable reward -> group advantages
                -> model.token_logprobs(...) with autograd -> clipped policy loss -> optimizer step
                -> the next rollout runs on the updated weights (same storage, nothing copied)

Task: "repeat the prompt's last token" (reward = fraction of completion tokens equal to it). A
tiny random Qwen3 learns it from scratch in about a minute of CPU. Every step logs the reward, the
max |rollout logprob - training logprob| over all sampled tokens (exactly 0: the rollout logprobs
are the old-policy logprobs as they are), the k3 estimate of KL(rollout || training) and the time
split. --compare-stock also scores the same samples with stock transformers (the same weights
loaded into e.g. transformers.Qwen3ForCausalLM) to show the mismatch a stock stack has. Writes
grpo_metrics.json and grpo.png (reward and mismatch per step, ours vs stock) to --out. Exits 1
when any sampled token's training logprob differs from its rollout logprob in any bit.

Examples:
    python examples/grpo.py --compare-stock                 # CPU, tiny random checkpoint
    python examples/grpo.py --model path/to/checkpoint      # a checkpoint of a supported architecture
    python examples/grpo.py --device cuda --dtype bfloat16 --config qwen3-0.6b --steps 20 --prompts 32 \\
        --group 8 --max-tokens 256 --micro-batch 32 --lr 1e-6 --compare-stock --out runs/grpo-qwen3-0.6b
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

from vexact_models.cli_args import (checkpoint_arg, config_arg, device_arg, non_negative_float, non_negative_int,
                                    positive_float, positive_int)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=checkpoint_arg,
                   help="checkpoint folder (or hub id) to train (default: write a random one for --config)")
    p.add_argument("--config", type=config_arg, default="tiny",
                   help="random checkpoint's shape: 'tiny' (default: Qwen3, 2 layers, vocab 16) or a bundled "
                        "published config (qwen3-0.6b, qwen3-8b, qwen3-30b-a3b, moonlight-16b-a3b, deepseek-v3)")
    p.add_argument("--layers", type=positive_int, help="override num_hidden_layers of --config")
    p.add_argument("--device", type=device_arg, default="cpu", help="cpu (default), cuda or cuda:N")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--steps", type=positive_int, default=40, help="rollout + update steps (default 40)")
    p.add_argument("--prompts", type=positive_int, default=16, help="prompts per step (default 16)")
    p.add_argument("--group", type=positive_int, default=8, help="samples per prompt, the GRPO group (default 8)")
    p.add_argument("--max-tokens", type=positive_int, default=2, help="completion tokens per sample (default 2)")
    p.add_argument("--prompt-len", default="4,8", help="min,max prompt length (default 4,8)")
    p.add_argument("--task-vocab", type=positive_int, default=16,
                   help="prompt tokens are drawn from [2, min(task_vocab, vocab_size)) (default 16)")
    p.add_argument("--stop-at-eos", action="store_true", help="let EOS end a completion (default: ignore EOS)")
    p.add_argument("--temperature", type=positive_float, default=1.0)
    p.add_argument("--lr", type=non_negative_float, default=5e-3,
                   help="AdamW learning rate (default 5e-3; fp32 master weights when --dtype is not float32)")
    p.add_argument("--clip", type=non_negative_float, default=0.2, help="PPO clip range epsilon (default 0.2)")
    p.add_argument("--epochs", type=positive_int, default=1,
                   help="policy updates per rollout batch (default 1; > 1 makes the clipping bite)")
    p.add_argument("--micro-batch", type=non_negative_int, default=0,
                   help="samples per forward/backward (gradients accumulate; default 0: the whole batch)")
    p.add_argument("--compare-stock", action="store_true",
                   help="also score the samples with stock transformers on the same weights")
    p.add_argument("--stock-attn", default="sdpa", choices=["sdpa", "eager"], help="stock model's attention")
    p.add_argument("--kv-cache-gb", type=positive_float, help="rollout KV cache size (default: 0.0625 on CPU, else "
                   "what --gpu-memory-utilization leaves)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.5,
                   help="CUDA: fraction of GPU memory weights + KV cache may take at engine start (default 0.5; "
                        "the rest is for training)")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for decode")
    p.add_argument("--threads", type=positive_int, default=1,
                   help="CPU: torch intra-op threads (default 1: a tiny model's ops only lose time to more)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="grpo_out", help="folder for grpo_metrics.json and grpo.png (default grpo_out)")
    args = p.parse_args(argv)
    try:
        lo, hi = (int(x) for x in args.prompt_len.split(","))
    except ValueError:
        p.error(f"--prompt-len {args.prompt_len!r}: expected MIN,MAX")
    args.prompt_len = (lo, hi)
    if args.group < 2:
        p.error(f"--group={args.group} must be >= 2 (GRPO compares samples within a group)")
    if not 1 <= lo <= hi:
        p.error(f"--prompt-len {lo},{hi}: need 1 <= MIN <= MAX")
    if args.task_vocab < 3:
        p.error(f"--task-vocab={args.task_vocab} must be >= 3 (prompt tokens are drawn from [2, task_vocab))")
    return args


def write_random_checkpoint(args: argparse.Namespace, path: Path) -> None:
    """A random-weight checkpoint of --config (stock HF layout, safetensors) in `path`."""
    from vexact_models.conformance.models import MIN_GPU_HEAD_DIM, architecture_of, build_model, make_config
    from vexact_models.registry import get

    if args.config == "tiny":
        arch = get("qwen3")
        config = arch.tiny_config(vocab_size=16, max_position_embeddings=256,
                                  **({"num_hidden_layers": args.layers} if args.layers else {}),
                                  **({"head_dim": MIN_GPU_HEAD_DIM} if args.device.type == "cuda" else {}))
    else:
        arch = architecture_of(args.config)
        config = make_config(arch, args.config, args.layers, None)
    # built on the target device: a published shape initialised on CPU takes minutes
    model = build_model(arch, config, torch.device(args.device), DTYPES[args.dtype], seed=args.seed)
    model.save_pretrained(path)
    del model


class StockScorer:
    """Stock transformers' class for the architecture, holding a copy of the policy's weights."""

    def __init__(self, path: str | Path, policy, device: torch.device, dtype: torch.dtype, attn: str) -> None:
        from vexact_models.registry import for_model_type

        hf_class = for_model_type(policy.config.model_type).hf_class()
        self.model = hf_class.from_pretrained(path, dtype=dtype, attn_implementation=attn).to(device).eval()
        self.name = f"{hf_class.__module__.split('.')[0]}.{hf_class.__name__} ({attn})"

    @torch.no_grad()
    def token_logprobs(self, policy, input_ids, attention_mask, temperature: float,
                       chunk_bytes: int = 2 << 30) -> torch.Tensor:
        """Logprobs aligned with `input_ids` (0 for the first token), the way RL stacks compute
        them from the forward's logits, after copying the policy's current weights in. Rows go
        through in chunks holding at most about `chunk_bytes` of fp32 logits."""
        self.model.load_state_dict(policy.state_dict())
        rows = max(1, chunk_bytes // (4 * input_ids.shape[1] * self.model.config.vocab_size))
        out = []
        for ids, mask in zip(input_ids.split(rows), attention_mask.split(rows)):
            logits = self.model(input_ids=ids, attention_mask=mask).logits.float()
            lp = torch.log_softmax(logits[:, :-1] / temperature, dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
            out.append(torch.cat([lp.new_zeros(lp.shape[0], 1), lp], dim=1))
        return torch.cat(out)


class MasterWeightsAdamW:
    """AdamW over fp32 copies of low-precision parameters: a bf16 step of 1e-6 on a weight of
    0.02 rounds away. After each step the fp32 values are rounded into the parameters in place,
    so the rollout engine, which shares their storage, samples from them next."""

    def __init__(self, params, lr: float) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.master = [p.detach().float().clone().requires_grad_(True) for p in self.params]
        self.optimizer = torch.optim.AdamW(self.master, lr=lr, weight_decay=0.0)

    def step(self) -> None:
        for p, m in zip(self.params, self.master):
            m.grad = None if p.grad is None else p.grad.float()
        self.optimizer.step()
        with torch.no_grad():
            for p, m in zip(self.params, self.master):
                p.copy_(m)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def rollout(llm, prompts: list[list[int]], args: argparse.Namespace):
    from vexact_models.rl import RolloutBatch
    from vexact_models.runtime import SamplingParams

    params = SamplingParams(n=args.group, temperature=args.temperature, max_tokens=args.max_tokens,
                            ignore_eos=not args.stop_at_eos)
    return RolloutBatch.from_outputs(llm.generate(prompts, params, use_tqdm=False))


def policy_update(model, optimizer, batch, advantages, args: argparse.Namespace, device: torch.device,
                  timings: dict) -> dict:
    """`--epochs` optimizer steps on one rollout batch. Epoch 0's forwards all run on the rollout's
    weights (gradients accumulate over micro-batches before the step): its logprobs are compared
    with the rollout's. Returns that comparison (`mismatch_stats`) and the first epoch's loss."""
    from vexact_models.rl import clipped_policy_loss, mismatch_stats

    size = args.micro_batch or len(batch)
    num_tokens = int(batch.completion_mask.sum())
    stats, first_loss = None, 0.0
    for epoch in range(args.epochs):
        t0 = time.perf_counter()
        current = []
        for mb, adv in zip(batch.micro_batches(size), advantages.split(size)):
            mb = mb.to(device)
            lp = model.token_logprobs(mb.input_ids, mb.attention_mask, temperature=args.temperature)
            loss = clipped_policy_loss(lp, mb.rollout_logprobs, adv.to(device), mb.completion_mask,
                                       args.clip, args.clip, num_tokens=num_tokens)
            loss.backward()
            current.append(lp.detach().cpu())
            first_loss += float(loss.detach()) if epoch == 0 else 0.0
        _sync(device)
        t1 = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        _sync(device)
        timings["train_s"] += t1 - t0
        timings["update_s"] += time.perf_counter() - t1
        if epoch == 0:
            stats = mismatch_stats(torch.cat(current), batch.rollout_logprobs, batch.completion_mask)
    return {**stats, "loss": first_loss}


def grpo_step(step: int, model, llm, optimizer, stock, prompt_rng, args, device) -> dict:
    from vexact_models.rl import group_advantages, mismatch_stats, random_prompts, repeat_last_token_reward

    vocab = range(2, min(args.task_vocab, model.config.vocab_size))
    prompts = random_prompts(args.prompts, vocab, *args.prompt_len, prompt_rng)
    timings = {"rollout_s": 0.0, "train_s": 0.0, "update_s": 0.0}
    t0 = time.perf_counter()
    batch = rollout(llm, prompts, args)
    _sync(device)
    timings["rollout_s"] = time.perf_counter() - t0
    rewards = torch.tensor([repeat_last_token_reward(p, c) for p, c in batch.pairs()])
    advantages = group_advantages(rewards, args.group)
    record = {"step": step, "reward": float(rewards.mean()), "tokens": int(batch.completion_mask.sum())}
    if stock is not None:  # before the update: the weights the rollout sampled with
        t1 = time.perf_counter()
        lp = stock.token_logprobs(model, batch.input_ids.to(device), batch.attention_mask.to(device),
                                  args.temperature).cpu()
        theirs = mismatch_stats(lp, batch.rollout_logprobs, batch.completion_mask)
        record.update({f"stock_{k}": theirs[k] for k in ("max_abs_delta", "mean_abs_delta", "k3_kl",
                                                          "mismatched_tokens")})
        timings["stock_s"] = time.perf_counter() - t1
    ours = policy_update(model, optimizer, batch, advantages, args, device, timings)
    record.update(ours)
    record.update(timings)
    return record


def print_row(r: dict, header: bool) -> None:
    cols = [("step", "{:>4}"), ("reward", "{:>6.3f}"), ("max_abs_delta", "{:>10.3g}"), ("k3_kl", "{:>9.3g}"),
            ("mismatched_tokens", "{:>8}"), ("stock_max_abs_delta", "{:>10.3g}"), ("stock_k3_kl", "{:>9.3g}"),
            ("rollout_s", "{:>8.3f}"), ("train_s", "{:>8.3f}"), ("update_s", "{:>8.3f}")]
    names = {"max_abs_delta": "max|d|", "k3_kl": "k3 KL", "mismatched_tokens": "differ",
             "stock_max_abs_delta": "stock max|d|", "stock_k3_kl": "stock k3", "rollout_s": "rollout",
             "train_s": "fwd+bwd", "update_s": "update"}
    cols = [(k, f) for k, f in cols if k in r]
    if header:
        print("  ".join(names.get(k, k).rjust(len(f.format(0)) if "g" not in f else 10) for k, f in cols))
    print("  ".join(f.format(r[k]) for k, f in cols), flush=True)


def plot(history: list[dict], path: Path, stock_name: str | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in history]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.plot(steps, [r["reward"] for r in history], marker="o", ms=3)
    ax1.set(xlabel="step", ylabel="mean reward", title="reward (repeat the prompt's last token)")
    ax2.plot(steps, [r["max_abs_delta"] for r in history], marker="o", ms=3, label="vexact-models (token_logprobs)")
    if stock_name:
        ax2.plot(steps, [r["stock_max_abs_delta"] for r in history], marker="s", ms=3, label=f"stock {stock_name}")
    ax2.set_yscale("symlog", linthresh=1e-8)  # shows exact zeros and tiny nonzero values on one axis
    ax2.set(xlabel="step", ylabel="max |rollout - training logprob|", title="training-inference mismatch")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from transformers import AutoModelForCausalLM

    import vexact_models
    from vexact_models.runtime import LLM

    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = tempfile.TemporaryDirectory()
    path = args.model
    if path is None:
        path = tmp.name
        write_random_checkpoint(args, Path(path))
    vexact_models.patch()
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
    stock = StockScorer(path, model, device, dtype, args.stock_attn) if args.compare_stock else None
    kv = {"kv_cache_bytes": int(args.kv_cache_gb * 2**30)} if args.kv_cache_gb else (
        {"kv_cache_bytes": 64 << 20} if device.type == "cpu" else {"gpu_memory_utilization": args.gpu_memory_utilization})
    llm = LLM(model, max_num_seqs=args.prompts * args.group, enforce_eager=args.enforce_eager, seed=args.seed, **kv)
    optimizer = (torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0) if dtype == torch.float32 else
                 MasterWeightsAdamW(model.parameters(), lr=args.lr))  # created after LLM: parameters as it left them
    print(f"policy {type(model).__module__}.{type(model).__name__} ({model.config.model_type}, "
          f"{sum(p.numel() for p in model.parameters()):,} parameters, {dtype}, {device}); rollout engine "
          f"LLM(model) sharing its weights" + (f"; stock scorer {stock.name}" if stock else ""), flush=True)
    prompt_rng = random.Random(args.seed)
    history = []
    for step in range(args.steps):
        history.append(grpo_step(step, model, llm, optimizer, stock, prompt_rng, args, device))
        print_row(history[-1], header=step == 0)
    summary = summarize(history)
    (out / "grpo_metrics.json").write_text(json.dumps({"args": vars(args), "summary": summary, "steps": history},
                                                       indent=1, default=str))
    plot(history, out / "grpo.png", stock.name if stock else None)
    print(json.dumps(summary))
    print(f"wrote {out / 'grpo_metrics.json'} and {out / 'grpo.png'}")
    tmp.cleanup()
    ok = summary["mismatched_tokens"] == 0
    print("RESULT:", "PASS (training logprobs == rollout logprobs, bitwise, at every step)" if ok else
          "FAIL (training logprobs differ from the rollout's)")
    return 0 if ok else 1


def summarize(history: list[dict]) -> dict:
    """First/last-5-step mean rewards, mismatch totals and mean step times (step 0 excluded from times)."""
    k = min(5, len(history))
    timed = history[1:] or history
    summary = {"steps": len(history), "reward_first": sum(r["reward"] for r in history[:k]) / k,
               "reward_last": sum(r["reward"] for r in history[-k:]) / k,
               "max_abs_delta": max(r["max_abs_delta"] for r in history),
               "mismatched_tokens": sum(r["mismatched_tokens"] for r in history),
               "tokens": sum(r["tokens"] for r in history)}
    for key in ("rollout_s", "train_s", "update_s", "stock_s"):
        if key in history[0]:
            summary[f"mean_{key}"] = sum(r[key] for r in timed) / len(timed)
    if "stock_max_abs_delta" in history[0]:
        summary["stock_max_abs_delta"] = max(r["stock_max_abs_delta"] for r in history)
        summary["stock_mismatched_tokens"] = sum(r["stock_mismatched_tokens"] for r in history)
    return summary


if __name__ == "__main__":
    sys.exit(main())
