"""Rollout throughput on the nano-vllm workload, beside stock HF ``generate`` in the same run.

Workload: 256 requests, prompt lengths uniform in [100, 1024], output lengths uniform in
[100, 1024], random token ids, ignore_eos, fixed seed. Model: random weights at a published
shape (default Qwen3-0.6B), bf16, CUDA.

- vexact: `LLM.generate` (aligned kernels, paged KV, continuous batching, chunked prefill).
- HF: ``model.generate`` of the stock transformers class on the same weights (sdpa), all
  requests in one left-padded batch (or ``--hf-batch`` per batch) with ``max_new_tokens`` the
  batch's longest output; only each request's own output length counts as useful tokens.

Usage: python benchmarks/throughput.py [--config qwen3-0.6b] [--requests 256] [--skip-hf]
"""

from __future__ import annotations

import argparse
import random
import sys
import time

import torch


def workload(n: int, vocab: int, seed: int, lo: int = 100, hi: int = 1024):
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]
    outputs = [rng.randint(lo, hi) for _ in range(n)]
    return prompts, outputs


def run_vexact(model, prompts, outputs, args) -> tuple[float, int]:
    from vexact_models.runtime import LLM, SamplingParams

    llm = LLM(model, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              max_model_len=2100, gpu_memory_utilization=args.gpu_memory_utilization)
    params = [SamplingParams(temperature=0.6, max_tokens=n, ignore_eos=True, seed=i) for i, n in enumerate(outputs)]
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up: compile kernels
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    assert produced == sum(outputs), (produced, sum(outputs))
    print(f"vexact: {llm.runner.num_blocks} KV blocks, {llm.num_preemptions} preemptions")
    del llm
    torch.cuda.empty_cache()
    return seconds, produced


@torch.no_grad()
def run_hf(arch, model, prompts, outputs, batch: int) -> tuple[float, int]:
    hf = arch.hf_class()._from_config(model.config, attn_implementation="sdpa")  # stock's fast path
    hf.load_state_dict(model.state_dict(), strict=False)
    hf = hf.to(device="cuda", dtype=torch.bfloat16).eval()
    if model.config.tie_word_embeddings:
        hf.tie_weights()
    order = sorted(range(len(prompts)), key=lambda i: outputs[i])
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for start in range(0, len(order), batch):
        idx = order[start:start + batch]
        width = max(len(prompts[i]) for i in idx)
        ids = torch.zeros(len(idx), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, i in enumerate(idx):
            ids[r, width - len(prompts[i]):] = torch.tensor(prompts[i])
            mask[r, width - len(prompts[i]):] = 1
        new = max(outputs[i] for i in idx)
        hf.generate(input_ids=ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=new, min_new_tokens=new,
                    do_sample=True, temperature=0.6, top_k=0, top_p=1.0, pad_token_id=0)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    del hf
    torch.cuda.empty_cache()
    return seconds, sum(outputs)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="qwen3-0.6b", help="bundled config name or config.json path")
    parser.add_argument("--layers", type=int, help="override num_hidden_layers")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    parser.add_argument("--hf-batch", type=int, default=64, help="requests per HF generate call (sorted by output length)")
    parser.add_argument("--skip-hf", action="store_true")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/throughput.py needs a CUDA GPU", file=sys.stderr)
        return 2
    from vexact_models.conformance.cli import build_model, make_config
    from vexact_models.registry import architectures

    config_fields = make_config(architectures()[0], args.config, args.layers, None)
    arch = [a for a in architectures() if config_fields.model_type in a.model_types][0]
    model = build_model(arch, config_fields, torch.device("cuda"), torch.bfloat16, args.seed)
    prompts, outputs = workload(args.requests, config_fields.vocab_size, args.seed)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; {args.config} "
          f"({config_fields.num_hidden_layers} layers), {args.requests} requests, "
          f"{sum(map(len, prompts))} prompt tokens, {sum(outputs)} output tokens")
    rows = []
    seconds, produced = run_vexact(model, prompts, outputs, args)
    rows.append(("vexact (aligned)", seconds, produced))
    print(f"vexact: {produced} output tokens in {seconds:.1f}s = {produced / seconds:,.0f} tok/s", flush=True)
    if not args.skip_hf:
        seconds, produced = run_hf(arch, model, prompts, outputs, args.hf_batch)
        rows.append((f"HF generate (batch {args.hf_batch})", seconds, produced))
    print(f"\n{'engine':<26}{'seconds':>10}{'output tokens':>15}{'output tok/s':>14}{'vs HF':>8}")
    hf_rate = rows[-1][2] / rows[-1][1] if len(rows) > 1 else None
    for name, seconds, produced in rows:
        rate = produced / seconds
        ratio = f"{rate / hf_rate:.1f}x" if hf_rate else "-"
        print(f"{name:<26}{seconds:>10.1f}{produced:>15,}{rate:>14,.0f}{ratio:>8}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
