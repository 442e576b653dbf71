"""Bitwise batch-invariance proof of the Triton kernels on a GPU (docs/design.md section 4).

Every check compares results computed under different batch compositions with ``torch.equal``
and allows zero mismatches:

- linear: every row of an M-row launch equals that row computed alone (M=1), for M in `M_SWEEP`
  at the (K, N) of every Qwen3-0.6B / Qwen3-8B / Qwen3-30B-A3B layer including the LM heads,
  plus rows in permuted positions, plus every tile config of the table forced on a few Ms.
- attention: each query's output is the same packed (training), in chunked prefill (several
  chunk sizes, random per-step chunks, mixed batches), and as decode steps over a paged cache
  with shuffled pages, for sequences up to 8192 tokens, at the Qwen3 head layouts; and every
  launch-parameter candidate (rows per program >= 64, warps, stages) against the first
  ("attention configs": decode and prefill launches pick different ones).
- rms_norm, log_softmax, gather_logprobs, token_logprobs, silu_and_mul, logit_softcap, rotary,
  rotary_cache_write (also == the separate ops): rows alone vs in batches; gather vs the full row;
  token_logprobs vs the sampler path, with and without the final logit soft cap.
- MoE (``--only moe``): `fused_moe` at the Qwen3-30B-A3B, Moonlight, DeepSeek-V3 and GPT-OSS-20B
  shapes, plain and with LoRA (r=16, fp32) on both expert tensors: each token alone == its row in
  batches of up to 16384 (skewed routing: experts with 0, 1 or thousands of rows), permuted
  batches, routing rows alone.
- latent MLA (``--only latent``): the latent attention kernel (one 576-dim key head, the value a
  view of its first 512 dims, 16 and 128 query heads) as the attention check runs it, packed vs
  chunked prefill vs decode over a latent paged cache, up to 8192 tokens; the absorption GEMMs
  (`kernels.head_linear`, on strided views of kv_b_proj) row alone vs in batches of up to 8192;
  the rollout's fused latent prologue (`kernels.latent_cache_write`) == the separate ops, and
  each token alone == in batches of up to 4096.
- the gated-DeltaNet hybrids' ops (``--only hybrid``, `hybrid_invariance.py`): the causal conv1d's
  rollout in pieces == its training forward; the gated and zero-centred norms, the sigmoid gate, the
  gated delta rule's gates (also == the CPU reference's bits) and partial rotary rows alone == in
  batches.
- attention FA4 (``--only fa4``, the optional flash-attn-4 package on a Hopper GPU): the attention
  check with FlashAttention-4 as the forward (`use_attention_forward("fa4")`), every shape
  including the qk-192 / v-128 MLA ones.
- linear quack (``--only quack``, the optional quack-kernels package on a Hopper GPU): quack's GEMM
  with every config `linear_quack.pick_config` returns, and quack's default, against our Triton
  kernel's rows, at every Qwen3 (K, N), with and without a bias, fp32 logits for the LM heads; and
  the gated MLPs' gate/up GEMM with SwiGLU in quack's epilogue (`kernels.linear_silu_and_mul`'s
  decode launch) against `linear` then `silu_and_mul`, every non-swapped table config.
- LoRA (``--only lora``, `lora_invariance.py`): `kernels.lora_add` at the Qwen3 projection groups,
  ranks 8/16/64, fp32 and bf16 adapters: rows alone == in batches, a stacked q/k/v or gate/up
  group == its members' separate calls, in place and in a CUDA graph == eager, the two launches
  (the expand adding the shrink's partials) == three (their sum a launch of its own), the
  training forward (which keeps u) == the rollout's.
- gated delta rule (``--only gdn``): the recurrent kernel training and rollout share: a batch
  trained in one launch == each sequence alone and other compositions and orders (outputs and
  final states); rollouts in prefill pieces and decodes == the packed training forward; engine
  rollouts through the state cache (padded plans, dry runs, CUDA graphs, preemption, a sibling's
  slot copy) == the packed training forward (`gated_delta_invariance.py`, docs/design.md section 6b).

The attention checks live in `attention_invariance.py`, the linear ones in `linear_invariance.py`.

Usage: ``python -m vexact_models.conformance.kernel_invariance [--quick] [--only GROUP] [--shapes NAMES]``
(needs CUDA); prints a table and exits non-zero on any mismatch. The attention part alone takes
15-40 s a shape on the H200 (``--quick``); ``--shapes`` splits it across calls.
"""

from __future__ import annotations

import argparse
import itertools
import random
import sys
import time

import torch

from vexact_models.kernels import (ExpertLora, add_rms_norm, apply_rotary, gather_logprobs, head_linear, linear, lm_head_logits,
                                   log_softmax, logit_softcap, rms_norm, rope_table, rotary_cache_write, silu_and_mul,
                                   token_logprobs, use_attention_forward)
from vexact_models.kernels.grouped_topk import sigmoid_grouped_topk
from vexact_models.kernels.linear_quack import device_unavailable_reason
from vexact_models.kernels.moe import fused_moe as plain_fused_moe
from vexact_models.kernels.moe_activation import SwigluClamp
from vexact_models.kernels.moe_routing import softmax_topk
from vexact_models.kernels.rotary_cache_write import rotary_cache_write_reference

from .attention_invariance import (LATENT_SHAPES, attention_shape_names, check_attention_configs,
                                  check_latent_attention, check_latent_cache_write, run_attention, selected_shapes,
                                  sequence_lengths)
from .gated_delta_invariance import GDN_CHECKS, run_gated_delta
from .hybrid_invariance import HYBRID_CHECKS, run_hybrid
from .invariance_result import Result
from .linear_invariance import M_SWEEP, run_linear, run_linear_quack
from .lora_invariance import run_lora

# (name, hidden, experts, expert intermediate, top-k, router): DeepSeek-V3 with 64 of its 256 experts
MOE_SHAPES = [("qwen3-30b-a3b", 2048, 128, 768, 8, "softmax"), ("moonlight", 2048, 64, 1408, 6, "sigmoid 1 group"),
              ("deepseek-v3", 7168, 64, 2048, 8, "sigmoid 8 groups"),
              ("gpt-oss-20b", 2880, 32, 2880, 4, "softmax gpt-oss")]


def check_head_linear(result: Result, heads: int, rank: int, nope: int, v_dim: int, quick: bool) -> None:
    """The absorption GEMMs on strided views of a kv_b_proj weight: rows alone == rows in batches."""
    weight = (torch.randn(heads, nope + v_dim, rank, device="cuda") / rank ** 0.5).bfloat16()
    w_uk_t, w_uv = weight[:, :nope].transpose(1, 2), weight[:, nope:]
    ms = [m for m in M_SWEEP if m <= (1024 if quick else 8192)]
    m_max = max(ms)
    q = torch.randn(m_max, heads, nope + 64, device="cuda").bfloat16()[:, :, :nope]  # a slice of the query
    o = torch.randn(m_max, heads, rank, device="cuda").bfloat16()
    rows = sorted({0, 1, 5, 63, 64, 127, m_max // 2, m_max - 1} | set(random.Random(heads).sample(range(m_max), 24)))
    for what, x, w in (("W_uk (query -> latent)", q, w_uk_t), ("W_uv (latent -> value)", o, w_uv)):
        single = torch.cat([head_linear(x[i:i + 1], w) for i in rows])
        for m in ms:
            keep = [j for j, i in enumerate(rows) if i < m]
            got = head_linear(x[:m], w)[[i for i in rows if i < m]]
            result.compare(got, single[keep], f"H={heads} {what} M={m}")


def check_rows(results: dict[str, Result], quick: bool) -> None:
    ms = [m for m in M_SWEEP if m <= (1024 if quick else 8192)]
    m_max = max(ms)
    for n in (128, 1024, 4096):
        x = torch.randn(m_max, n, device="cuda").bfloat16()
        w = (torch.rand(n, device="cuda") + 0.5).bfloat16()
        single = torch.cat([rms_norm(x[i:i + 1], w, 1e-6) for i in range(m_max)])
        r = torch.randn(m_max, n, device="cuda").bfloat16()
        fused = torch.cat([add_rms_norm(x[i:i + 1], r[i:i + 1], w, 1e-6)[0] for i in range(m_max)])
        for m in ms:
            results["rms_norm"].compare(rms_norm(x[:m], w, 1e-6), single[:m], f"N={n} M={m}")
            results["rms_norm"].compare(add_rms_norm(x[:m], r[:m], w, 1e-6)[0], fused[:m], f"add+norm N={n} M={m}")
        results["rms_norm"].compare(fused, rms_norm(x + r, w, 1e-6), f"add+norm == add, then norm N={n}")
    vocab = 151936
    logits = torch.randn(min(m_max, 2048), vocab, device="cuda") * 4
    temps = torch.rand(logits.shape[0], device="cuda") + 0.5
    targets = torch.randint(0, vocab, (logits.shape[0],), device="cuda")
    single_lp = torch.cat([gather_logprobs(logits[i:i + 1], targets[i:i + 1], temps[i:i + 1])
                           for i in range(logits.shape[0])])
    single_row = log_softmax(logits[:1], temps[:1])
    for m in [m for m in ms if m <= logits.shape[0]]:
        results["log_softmax"].compare(gather_logprobs(logits[:m], targets[:m], temps[:m]), single_lp[:m], f"gather M={m}")
        full = log_softmax(logits[:m], temps[:m])
        results["log_softmax"].compare(full[:1], single_row, f"row 0 of M={m}")
        results["log_softmax"].compare(full[torch.arange(m, device="cuda"), targets[:m]], single_lp[:m],
                                       f"full row gathered M={m}")
    for hidden in (1024, 2048, 4096):
        h = torch.randn(512, hidden, device="cuda").bfloat16()
        w = (torch.randn(vocab, hidden, device="cuda") / hidden ** 0.5).bfloat16()
        t = torch.randint(0, vocab, (512,), device="cuda")
        sampler = torch.cat([gather_logprobs(linear(h[i:i + 1], w, out_dtype=torch.float32), t[i:i + 1], 0.7)
                             for i in range(512)])
        for chunk in (1, 100, 512):
            results["token_logprobs"].compare(token_logprobs(h, w, t, 0.7, chunk_tokens=chunk), sampler,
                                              f"hidden={hidden} chunk={chunk} vs sampler path")
        capped = torch.cat([gather_logprobs(lm_head_logits(h[i:i + 1], w, 30.0), t[i:i + 1], 0.7) for i in range(512)])
        for chunk in (1, 100, 512):  # Gemma's final_logit_softcapping: the cap on both paths
            results["token_logprobs"].compare(token_logprobs(h, w, t, 0.7, chunk_tokens=chunk, softcap=30.0), capped,
                                              f"hidden={hidden} chunk={chunk} softcap=30 vs sampler path")
    g = torch.randn(m_max, 3072, device="cuda").bfloat16()
    u = torch.randn(m_max, 3072, device="cuda").bfloat16()
    full = silu_and_mul(g, u)
    for m in ms:
        results["elementwise"].compare(silu_and_mul(g[m - 1:m], u[m - 1:m]), full[m - 1:m], f"silu_and_mul row {m - 1}")
    logits = torch.randn(m_max, 3072, device="cuda") * 40
    full = logit_softcap(logits, 30.0)
    for m in ms:
        results["elementwise"].compare(logit_softcap(logits[m - 1:m], 30.0), full[m - 1:m], f"logit_softcap row {m - 1}")
        results["elementwise"].compare(logit_softcap(logits[:m, 5:], 30.0), full[:m, 5:], f"logit_softcap M={m} offset 5")
    cos, sin = (t.cuda() for t in rope_table(1.0 / (1e6 ** (torch.arange(0, 128, 2) / 128)), 40960))
    xq = torch.randn(m_max, 16, 128, device="cuda").bfloat16()
    pos = torch.randint(0, 40960, (m_max,), device="cuda")
    full = apply_rotary(xq, pos, cos, sin)
    for m in ms:
        results["elementwise"].compare(apply_rotary(xq[m - 1:m], pos[m - 1:m], cos, sin), full[m - 1:m],
                                       f"rotary row {m - 1}")
    check_rotary_cache_write(results["rotary_cache_write"], ms)


def check_rotary_cache_write(result: Result, ms: list[int], hq: int = 32, hkv: int = 8, d: int = 128,
                             rotary_dim: int | None = None, zero_centred: bool = False, name: str = "") -> None:
    """The rollout's fused q/k norm + rotary + KV cache write (Qwen3-8B heads by default; Qwen3.5's
    partial rotary `rotary_dim` and zero-centred norms where given) with the norms, then without as
    for Llama: the rotated queries and the cache of M tokens at once equal those of the separate ops
    training runs, and each token's equal the token's alone."""
    m_max, r = max(ms), rotary_dim or d
    cos, sin = (t.cuda() for t in rope_table(1.0 / (1e6 ** (torch.arange(0, r, 2) / r)), 40960))
    qkv = torch.randn(m_max, (hq + 2 * hkv) * d, device="cuda").bfloat16() * 3
    q, k, v = (t.view(m_max, -1, d) for t in qkv.split([hq * d, hkv * d, hkv * d], dim=1))
    pos = torch.randint(0, 40960, (m_max,), device="cuda")
    slots = torch.randperm(m_max, device="cuda")
    for norms in ((torch.rand(d, device="cuda") + 0.5).bfloat16(), (torch.rand(d, device="cuda") + 0.5).bfloat16()), (None, None):
        label = name + ("with q/k norms" if norms[0] is not None else "no norms")
        caches = [torch.zeros(m_max, 1, hkv, d, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
        full = rotary_cache_write(q, k, v, pos, cos, sin, caches[0], caches[1], slots, *norms, zero_centred=zero_centred)
        want = rotary_cache_write_reference(q, k, v, pos, cos, sin, caches[2], caches[3], slots, *norms,
                                            zero_centred=zero_centred)
        result.compare(full, want, f"{label}: queries == separate ops, M={m_max}")
        result.compare(torch.cat(caches[:2]), torch.cat(caches[2:]), f"{label}: K/V cache == separate ops, M={m_max}")
        for m in ms:
            alone = [torch.zeros(m_max, 1, hkv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
            row = rotary_cache_write(q[m - 1:m], k[m - 1:m], v[m - 1:m], pos[m - 1:m], cos, sin, *alone, slots[m - 1:m],
                                     *norms, zero_centred=zero_centred)
            result.compare(row, full[m - 1:m], f"{label}: token {m - 1} alone")
            s = slots[m - 1]
            result.compare(torch.cat([alone[0][s], alone[1][s]]), torch.cat([caches[0][s], caches[1][s]]),
                           f"{label}: token {m - 1}'s cache rows alone")


def _route(logits: torch.Tensor, top_k: int, router: str):
    if router.startswith("softmax"):
        return softmax_topk(logits, top_k, True)
    n_group = int(router.split()[1])
    bias = torch.linspace(-0.05, 0.05, logits.shape[1], device=logits.device)
    return sigmoid_grouped_topk(logits, bias, top_k, n_group, max(1, n_group // 2), True, 2.5)


def _expert_adapters(gate_up: torch.Tensor, down: torch.Tensor, rank: int = 16) -> dict:
    """Random fp32 LoRA adapters (PEFT's default dtype and layout) on both expert tensors."""
    experts, inter2, hidden = gate_up.shape

    def adapter(n: int, k: int, scaling: float) -> ExpertLora:
        return ExpertLora(torch.randn(experts * rank, k, device="cuda") / k ** 0.5,
                          torch.randn(n, rank * experts, device="cuda") * 0.1, scaling)
    return dict(gate_up_lora=adapter(inter2, hidden, 2.0), down_lora=adapter(hidden, inter2 // 2, 0.5))


def _moe_form(router: str, gate_up: torch.Tensor, down: torch.Tensor, adapters: dict | None = None):
    """`fused_moe` as the shape's model calls it: plain, or GPT-OSS's form (HF's transposed
    ``[E, H, 2I]`` / ``[E, I, H]`` parameters read as views, interleaved gate/up rows, biases
    large enough that the clamped SwiGLU's limit acts); with LoRA `adapters` on the experts
    (`_expert_adapters`) when given."""
    adapters = adapters or {}
    if not router.endswith("gpt-oss"):
        return lambda *args: plain_fused_moe(*args, **adapters)
    experts, inter2, hidden = gate_up.shape
    gate_up_t = (gate_up * 3).transpose(1, 2).contiguous().transpose(1, 2)  # the parameter's storage order
    down_t = down.transpose(1, 2).contiguous().transpose(1, 2)
    gate_up_bias = (torch.randn(experts, inter2, device="cuda") * 3).bfloat16()
    down_bias = torch.randn(experts, hidden, device="cuda").bfloat16()

    def run(x, _gate_up, _down, weights, ids):
        return plain_fused_moe(x, gate_up_t, down_t, weights, ids, gate_up_bias=gate_up_bias, down_bias=down_bias,
                               clamp=SwigluClamp(), interleaved=True, **adapters)
    return run


def check_moe(results: dict[str, Result], quick: bool) -> None:
    """MoE shapes, plain and with LoRA adapters (r=16, fp32) on both expert tensors: each token's
    output computed alone equals its row in batches of 64 ... 16384 tokens, with a skewed router
    so experts receive 0, 1 or thousands of rows; routing rows alone equal their rows in the batch."""
    for (name, hidden, experts, inter, top_k, router), adapted in itertools.product(MOE_SHAPES, (False, True)):
        gate_up = (torch.randn(experts, 2 * inter, hidden, device="cuda") / hidden ** 0.5).bfloat16()
        down = (torch.randn(experts, hidden, inter, device="cuda") / inter ** 0.5).bfloat16()
        fused_moe = _moe_form(router, gate_up, down, _expert_adapters(gate_up, down) if adapted else None)
        name = f"{name} + expert LoRA" if adapted else name
        n_max = 4096 if quick else 16384
        x = torch.randn(n_max, hidden, device="cuda").bfloat16()
        logits = torch.randn(n_max, experts, device="cuda")
        logits[:, 0] += 4.0  # expert 0: nearly every token
        logits[:, experts - experts // 8:] -= 20.0  # the last eighth: (almost) never
        logits[7, experts - 1] += 40.0  # the last expert: one token
        weights, ids = _route(logits, top_k, router)
        rows = torch.tensor([0, 7, 1, 63, 500, n_max - 1], device="cuda")
        single = torch.cat([fused_moe(x[i:i + 1], gate_up, down, weights[i:i + 1], ids[i:i + 1]) for i in rows.tolist()])
        counts = torch.bincount(ids.reshape(-1), minlength=experts)
        print(f"moe {name}: expert rows at {n_max} tokens: max {int(counts.max())}, experts with 0 rows "
              f"{int((counts == 0).sum())}, with 1 row {int((counts == 1).sum())}", flush=True)
        for n in (64, 512, 4096, 16384):
            if n > n_max:
                continue
            full = fused_moe(x[:n], gate_up, down, weights[:n], ids[:n])
            keep = rows < n
            results["moe"].compare(full[rows[keep]], single[keep], f"{name} fused_moe rows in a batch of {n}")
            perm = torch.randperm(n, device="cuda")
            results["moe"].compare(fused_moe(x[perm], gate_up, down, weights[perm], ids[perm])[torch.argsort(perm)],
                                   full, f"{name} fused_moe batch of {n} permuted")
        for i in rows.tolist():
            w1, i1 = _route(logits[i:i + 1], top_k, router)
            results["moe"].compare(w1, weights[i:i + 1], f"{name} {router} routing weights row {i} alone")
            results["moe"].compare(i1, ids[i:i + 1], f"{name} {router} routing ids row {i} alone")
        del gate_up, down, x
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer shapes and M up to 1024 (a smoke run)")
    parser.add_argument("--only", choices=["linear", "attention", "fa4", "quack", "latent", "rows", "moe", "gdn", "hybrid",
                                           "lora"],
                        help="run one group of checks (latent: MLA's latent attention and absorption GEMMs; fa4: "
                             "the attention checks with FlashAttention-4 as the forward; quack: quack-kernels' GEMM "
                             "against our linear; fa4 and quack are not part of the default run)")
    parser.add_argument("--shapes", type=str, default=None,
                        help="comma-separated names of the attention and latent shapes to check (default: all of "
                             f"them: {', '.join(attention_shape_names())}); lets a long sweep run in parts")
    args = parser.parse_args(argv)
    try:
        shape_names = selected_shapes(args.shapes)
    except ValueError as e:
        parser.error(str(e))
    if not torch.cuda.is_available():
        print("kernel_invariance: needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    names = ["linear", "linear configs", "linear quack", "linear silu_and_mul quack",
             "attention", "attention configs", "attention FA4", "latent attention",
             "head_linear", "latent_cache_write", "rms_norm", "rotary_cache_write",
             "log_softmax",
             "token_logprobs", "elementwise", "moe", *GDN_CHECKS,
             *HYBRID_CHECKS, "lora_add"]
    results = {n: Result(n) for n in names}
    t0 = time.time()
    if args.only in (None, "linear"):
        run_linear(results, args.quick)
    if args.only == "quack":  # the optional quack-kernels package: its rows are our kernel's
        reason = device_unavailable_reason()
        if reason is not None:
            print(f"kernel_invariance --only quack: {reason}", file=sys.stderr)
            return 2
        run_linear_quack(results, args.quick)
    if args.only in (None, "attention"):
        run_attention(results["attention"], results["attention configs"], shape_names, args.quick)
    if args.only == "fa4":  # the optional flash-attn-4 package: training == prefill == decode under it too
        with use_attention_forward("fa4"):
            run_attention(results["attention FA4"], None, shape_names, args.quick)
    if args.only in (None, "latent"):
        run_latent(results, shape_names, args.quick)
    if args.only in (None, "rows"):
        check_rows(results, args.quick)
    if args.only in (None, "moe"):
        check_moe(results, args.quick)
    if args.only in (None, "gdn"):
        run_gated_delta(results, args.quick)
    if args.only in (None, "lora"):
        run_lora(results, M_SWEEP, args.quick)
    if args.only in (None, "hybrid"):
        run_hybrid(results, args.quick)
        check_rotary_cache_write(results["partial rotary"], [m for m in M_SWEEP if m <= (1024 if args.quick else 4096)],
                                 16, 2, 256, 64, True, "qwen3.5 heads (64 of 256 rotated, zero-centred norms) ")
    torch.cuda.synchronize()
    print(f"\nkernel invariance on {torch.cuda.get_device_name()} (torch {torch.__version__}), {time.time() - t0:.0f}s")
    return 1 if print_results(results) else 0


def run_latent(results: dict[str, Result], shape_names: set[str], quick: bool) -> None:
    """The latent MLA attention, its launch configs, the absorption GEMMs and the fused prologue at
    each latent shape named in `shape_names`."""
    for name, hq, rank, rope, nope, v_dim in (s for s in LATENT_SHAPES if s[0] in shape_names):
        check_latent_attention(results["latent attention"], hq, rank, rope, sequence_lengths(quick), quick)
        check_attention_configs(results["attention configs"], hq, 1, rank + rope, rank, latent=True)
        check_head_linear(results["head_linear"], hq, rank, nope, v_dim, quick)
        check_latent_cache_write(results["latent_cache_write"], hq, rank, rope, nope,
                                 [m for m in M_SWEEP if m <= (1024 if quick else 4096)])
        print(f"{name}: {results['latent attention'].mismatches} attention and {results['head_linear'].mismatches} "
              "head_linear mismatches so far", flush=True)


def print_results(results: dict[str, Result]) -> bool:
    """The table of every check that ran, its first notes, and the verdict; whether any failed."""
    width = max([16] + [len(r.name) + 2 for r in results.values() if r.cases])
    print(f"{'check':<{width}}{'cases':>8}{'elements':>16}{'mismatches':>12}")
    failed = False
    for r in results.values():
        if r.cases:
            print(f"{r.name:<{width}}{r.cases:>8}{r.elements:>16,}{r.mismatches:>12}")
            failed |= r.mismatches > 0
            for note in r.notes[:10]:
                print(f"    {note}")
    print("RESULT:", "FAIL" if failed else "PASS (zero mismatches)")
    return failed


if __name__ == "__main__":
    sys.exit(main())
