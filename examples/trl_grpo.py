"""TRL's GRPOTrainer, exactly on-policy: `VexactGRPOTrainer` generates with vexact_models.LLM and
computes the trainer's per-token logprobs with token_logprobs' kernel, so TRL's own metrics read
sampling/sampling_logp_difference/max = 0 and sampling/importance_sampling_ratio/{min,max} = 1.

Task: "repeat the prompt's last token" over a word-level toy tokenizer (token i <-> "t<i>"), on a
random checkpoint this script writes (or --model). Modes:
    vexact        VexactGRPOTrainer: rollouts through LLM, exact training logprobs (default)
    trl-logprobs  VexactGRPOTrainer(exact_logprobs=False): rollouts through LLM, TRL's own logprob
                  kernel (its metrics then show a nonzero mismatch)
    stock         plain trl.GRPOTrainer on stock transformers (TRL's default model.generate; no
                  sampler logprobs, so no mismatch metric): the step-time baseline
    patched-cb    plain trl.GRPOTrainer after vexact_models.patch(), with TRL's
                  use_transformers_continuous_batching: its generate_batch runs on our rollout
                  engine (vexact_models.batch_generation), its logprobs are our forward's; no code
                  change beyond patch() (TRL reads no sampler logprobs there: no mismatch metric)
    stock-cb      the same on stock transformers (transformers' own paged runtime): its baseline
Prints TRL's logged metrics per step (reward, mismatch, importance ratio, step and generation
time) and writes them to --out/trl_grpo_metrics.json. In mode vexact, exits 1 if TRL logged any
nonzero logprob difference.

Examples:
    python examples/trl_grpo.py                                   # CPU, tiny random Qwen3
    python examples/trl_grpo.py --mode trl-logprobs               # the same run, TRL's logprobs
    python examples/trl_grpo.py --mode patched-cb                 # plain TRL, patch(), its continuous batching
    python examples/trl_grpo.py --lora 8                          # PEFT LoRA r=8 on every projection
    python examples/trl_grpo.py --device cuda --dtype bfloat16 --config qwen3-0.6b --steps 5 \\
        --prompts 16 --group 8 --max-tokens 256 --lr 1e-6 --mode stock
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

from vexact_models.cli_args import checkpoint_arg, config_arg, device_arg, non_negative_float, positive_int
from vexact_models.conformance.models import published_shape

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
METRICS = {"reward": "reward", "sampling/sampling_logp_difference/max": "max|d|",
           "sampling/sampling_logp_difference/mean": "mean|d|", "sampling/importance_sampling_ratio/min": "IS min",
           "sampling/importance_sampling_ratio/max": "IS max", "entropy": "entropy", "step_time": "step s",
           "generation_time": "gen s"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", default="vexact", choices=["vexact", "trl-logprobs", "stock", "patched-cb", "stock-cb"])
    p.add_argument("--model", type=checkpoint_arg, help="checkpoint folder (default: write a random one for --config)")
    p.add_argument("--config", type=config_arg, default="tiny",
                   help="random checkpoint's shape: 'tiny' (Qwen3, 2 layers, vocab 16) or a bundled published Qwen3 "
                        "config (qwen3-0.6b, qwen3-8b)")
    p.add_argument("--layers", type=positive_int, help="override num_hidden_layers of --config")
    p.add_argument("--device", type=device_arg, default="cpu", help="cpu (default), cuda or cuda:N")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--steps", type=positive_int, default=8, help="optimizer steps (default 8)")
    p.add_argument("--prompts", type=positive_int, default=4, help="prompts per step (default 4)")
    p.add_argument("--group", type=positive_int, default=8, help="completions per prompt, num_generations (default 8)")
    p.add_argument("--max-tokens", type=positive_int, default=4, help="max_completion_length (default 4)")
    p.add_argument("--prompt-len", default="4,8", help="min,max prompt length (default 4,8)")
    p.add_argument("--task-vocab", type=positive_int, default=16, help="prompt tokens from [2, task_vocab) (default 16)")
    p.add_argument("--lora", type=positive_int, metavar="R",
                   help="train PEFT LoRA adapters of rank R on every linear layer (lora_alpha 2R, no dropout; "
                        "TRL's peft_config) instead of the full model")
    p.add_argument("--lr", type=non_negative_float, default=5e-3, help="learning rate (default 5e-3: a tiny random model)")
    p.add_argument("--threads", type=positive_int, default=1, help="CPU: torch threads (default 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="trl_grpo_out", help="TRL output_dir and metrics file folder")
    args = p.parse_args(argv)
    try:
        args.prompt_len = tuple(int(x) for x in args.prompt_len.split(","))
        lo, hi = args.prompt_len
    except ValueError:
        p.error(f"--prompt-len {args.prompt_len!r}: expected MIN,MAX")
    if not 1 <= lo <= hi:
        p.error(f"--prompt-len {lo},{hi}: need 1 <= MIN <= MAX")
    if args.group < 2:
        p.error(f"--group={args.group} must be >= 2")
    if args.task_vocab < 3:
        p.error(f"--task-vocab={args.task_vocab} must be >= 3 (prompt tokens are drawn from [2, task_vocab))")
    if args.model is None and args.config != "tiny" and published_shape(args.config)[0].name != "qwen3":
        p.error(f"--config {args.config}: the random checkpoint is a Qwen3 one; pass a Qwen3 config, or --model "
                "with a checkpoint of another architecture")
    return args


def toy_tokenizer(config):
    """A word-level tokenizer over the whole vocabulary: id i <-> "t<i>", EOS <-> "<eos>"."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    eos = config.eos_token_id[0] if isinstance(config.eos_token_id, list) else config.eos_token_id
    vocab = {("<eos>" if i == eos else f"t{i}"): i for i in range(config.vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<eos>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece()  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<eos>")


def toy_dataset(args: argparse.Namespace, vocab_size: int):
    """Text prompts of random "t<i>" words and their last token id (the reward's target)."""
    from datasets import Dataset

    from vexact_models.rl import random_prompts

    rng = random.Random(args.seed)
    prompts = random_prompts(args.prompts * args.steps, range(2, min(args.task_vocab, vocab_size)), *args.prompt_len,
                             rng)
    return Dataset.from_dict({"prompt": [" ".join(f"t{t}" for t in p) for p in prompts],
                              "last_token": [p[-1] for p in prompts]})


def repeat_last_token(completion_ids, last_token, **kwargs) -> list[float]:
    """TRL reward function: the fraction of completion tokens equal to the prompt's last token."""
    from vexact_models.rl import repeat_last_token_reward

    return [repeat_last_token_reward([t], c) for c, t in zip(completion_ids, last_token)]


def write_checkpoint(args: argparse.Namespace, path: str) -> None:
    from vexact_models.conformance.models import MIN_GPU_HEAD_DIM, build_model, make_config
    from vexact_models.registry import get

    arch = get("qwen3")
    if args.config == "tiny":
        config = arch.tiny_config(vocab_size=16, max_position_embeddings=256,
                                  **({"num_hidden_layers": args.layers} if args.layers else {}),
                                  **({"head_dim": MIN_GPU_HEAD_DIM} if args.device.type == "cuda" else {}))
    else:
        config = make_config(arch, args.config, args.layers, None)
        if config.eos_token_id is None:  # the bundled published shapes carry no special tokens
            config.eos_token_id = config.vocab_size - 1
    build_model(arch, config, torch.device(args.device), DTYPES[args.dtype], seed=args.seed).save_pretrained(path)


def timed(trainer_class):
    """`trainer_class` that also logs each generation call's seconds as ``generation_time``."""

    class Timed(trainer_class):
        def _generate_single_turn(self, *a, **k):
            t0 = time.perf_counter()
            out = super()._generate_single_turn(*a, **k)
            if self.accelerator.device.type == "cuda":
                torch.cuda.synchronize()
            self._metrics["train"]["generation_time"].append(time.perf_counter() - t0)
            return out

    return Timed


def lora_config(args: argparse.Namespace):
    """TRL's ``peft_config`` for --lora (None without it)."""
    if args.lora is None:
        return None
    from peft import LoraConfig

    return LoraConfig(r=args.lora, lora_alpha=2 * args.lora, lora_dropout=0.0, target_modules="all-linear")


def build_trainer(args: argparse.Namespace, path: str):
    """The trainer of --mode on the checkpoint at `path`."""
    from transformers import AutoConfig
    from trl import GRPOConfig, GRPOTrainer

    import vexact_models

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    dtype = DTYPES[args.dtype]
    config = AutoConfig.from_pretrained(path)
    grpo_args = GRPOConfig(
        output_dir=args.out, max_steps=args.steps, per_device_train_batch_size=args.prompts * args.group,
        num_generations=args.group, max_completion_length=args.max_tokens, learning_rate=args.lr, beta=0.0,
        logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True, seed=args.seed,
        bf16=dtype == torch.bfloat16, use_cpu=args.device.type == "cpu",
        gradient_checkpointing=args.device.type != "cpu",  # TRL's default on GPUs; a tiny CPU model needs none
        shuffle_dataset=False, use_transformers_continuous_batching=args.mode.endswith("-cb"))
    common = dict(reward_funcs=repeat_last_token, args=grpo_args, train_dataset=toy_dataset(args, config.vocab_size),
                  processing_class=toy_tokenizer(config), peft_config=lora_config(args))
    if args.mode in ("stock", "stock-cb"):
        from vexact_models.registry import for_model_type

        model = for_model_type(config.model_type).hf_class().from_pretrained(path, dtype=dtype)
        return timed(GRPOTrainer)(model=model, **common)
    from vexact_models.integrations.trl import VexactGRPOTrainer

    from transformers import AutoModelForCausalLM

    vexact_models.patch()  # AutoModelForCausalLM now returns our class for the checkpoint's model_type
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    finally:
        vexact_models.unpatch()  # leave transformers as it was (run() is also called in-process)
    if args.mode == "patched-cb":  # stock TRL, our class: its generate_batch runs on the rollout engine
        return timed(GRPOTrainer)(model=model, **common)
    llm_kwargs = {"kv_cache_bytes": 64 << 20} if args.device.type == "cpu" else {}
    return timed(VexactGRPOTrainer)(model=model, exact_logprobs=args.mode == "vexact", llm_kwargs=llm_kwargs,
                                    **common)


def run(args: argparse.Namespace) -> list[dict]:
    """Train; return TRL's per-step logs (``trainer.state.log_history`` without the summary)."""
    from transformers import PrinterCallback

    threads = torch.get_num_threads()
    if args.device.type == "cpu":
        torch.set_num_threads(args.threads)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            path = args.model or tmp
            if args.model is None:
                write_checkpoint(args, path)
            trainer = build_trainer(args, path)
            trainer.remove_callback(PrinterCallback)  # main() prints its own table
            trainer.train()
    finally:
        torch.set_num_threads(threads)  # run() is also called in-process (tests)
    return [h for h in trainer.state.log_history if "reward" in h]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logs = run(args)
    keys = [k for k in METRICS if any(k in h for h in logs)]
    print("step  " + "  ".join(f"{METRICS[k]:>10}" for k in keys))
    for h in logs:
        print(f"{h['step']:>4}  " + "  ".join(f"{h[k]:>10.4g}" if k in h else f"{'-':>10}" for k in keys))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "trl_grpo_metrics.json").write_text(json.dumps({"args": vars(args), "steps": logs}, indent=1, default=str))
    diffs = [h["sampling/sampling_logp_difference/max"] for h in logs if "sampling/sampling_logp_difference/max" in h]
    if diffs:
        print(f"TRL's sampling/sampling_logp_difference/max over {len(diffs)} steps: max {max(diffs):.3g}")
    if args.mode == "vexact" and (len(diffs) != len(logs) or any(d != 0 for d in diffs)):
        print("FAIL: TRL logged a nonzero (or no) rollout-vs-training logprob difference")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
