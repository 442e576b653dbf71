"""Each aligned kernel beside its stock counterpart, measured in the same run (CUDA only).

Peers: cuBLAS via ``torch.matmul``, torch SDPA with the flash backend, ``torch.nn.functional.
rms_norm``, ``torch.log_softmax``, ``silu(g) * u``. The HBM reference is a device-to-device copy
measured here (bytes read + written). Times are medians of ``triton.testing.do_bench``, except
the row and element-wise kernels': replays of CUDA graphs (`bench_graph`), since a host loop of
launches measures the host for kernels of a few microseconds.

Targets (benchmark figures, not timed tests): linear >= 0.8x cuBLAS TFLOP/s at
M >= 4096 and >= 60% of HBM bandwidth at M <= 64; attention prefill >= 0.6x SDPA flash; decode
attention >= 50% of HBM bandwidth. The attention backward has four rows per shape, each forced
with ``use_attention_backward`` on our forward's out/lse: our Triton kernel ("bwd triton"),
torch's FlashAttention-2 backward ("bwd flash"), cuDNN's ("bwd cudnn", n/a without the cuDNN
frontend) and FlashAttention-4's ("bwd fa4", n/a without flash-attn-4 or off Hopper); training
runs the first of cudnn, fa4, flash, triton that applies
(``VEXACT_ATTENTION_BACKWARD``, default auto; kernels/attention_backward_choice.py).

Usage: python benchmarks/kernel_peers.py [--only linear|attention|rows] [--quick]
       python benchmarks/kernel_peers.py --sweep-linear [--sweep-shapes dsv3] [--sweep-m 16,256]
       python benchmarks/kernel_peers.py --sweep-log-softmax
"""

from __future__ import annotations

import argparse
import importlib
import sys

import torch

from bench_utils import bench, bench_graph, copy_bandwidth, decode_layout, rotating_copies, table


def bench_linear(hbm: float, quick: bool) -> None:
    from vexact_models.kernels import linear

    shapes = [("0.6b gate/up", 1024, 3072), ("8b q/o", 4096, 4096), ("8b gate/up", 4096, 12288),
              ("8b down", 12288, 4096), ("0.6b lm_head", 1024, 151936)]
    ms = [1, 16, 64, 256, 1024, 4096, 8192] if not quick else [1, 64, 4096]
    rows = []
    for name, k, n in shapes:
        w = (torch.randn(n, k, device="cuda") / k ** 0.5).bfloat16()
        for m in ms:
            x = torch.randn(m, k, device="cuda").bfloat16()
            t_ours = bench(lambda: linear(x, w))
            t_cublas = bench(lambda: torch.matmul(x, w.t()))
            flops = 2 * m * n * k
            nbytes = 2 * (m * k + n * k + m * n)
            rows.append([name, m, k, n, f"{t_ours * 1e3:.1f}", f"{t_cublas * 1e3:.1f}",
                         f"{flops / t_ours / 1e9:.0f}", f"{flops / t_cublas / 1e9:.0f}", f"{t_cublas / t_ours:.2f}",
                         f"{nbytes / t_ours / 1e6:.0f}", f"{100 * nbytes / t_ours / 1e6 / hbm:.0f}%"])
    table("linear (bf16) vs cuBLAS", ["shape", "M", "K", "N", "ours us", "cuBLAS us", "ours TFLOP/s",
                                       "cuBLAS TFLOP/s", "ratio", "ours GB/s", "% HBM"], rows)


LARGE_M_CANDIDATES = [
    (128, 256, 8, 3, True, False), (128, 256, 8, 3, True, True), (128, 128, 8, 4, True, False),
    (128, 128, 4, 4, True, False), (128, 128, 8, 5, True, True), (128, 256, 8, 3, False, False),
]
SMALL_M_CANDIDATES = [
    (64, 16, 4, 8, False, False), (64, 16, 4, 12, False, False), (64, 32, 4, 8, False, False),
    (64, 32, 4, 10, False, False), (64, 64, 4, 6, False, False), (64, 64, 8, 6, False, False),
    (64, 128, 4, 4, False, False), (64, 16, 4, 8, True, False), (64, 32, 4, 8, True, False),
    (64, 64, 4, 6, True, False), (64, 128, 4, 4, True, False),
]
MID_M_CANDIDATES = [
    (64, 64, 4, 6, False, False), (64, 128, 4, 4, False, False), (128, 64, 4, 4, False, False),
    (64, 64, 4, 6, True, False), (64, 128, 4, 4, True, False), (128, 128, 8, 4, True, False),
    (128, 256, 8, 3, True, False), (64, 32, 4, 8, False, False), (128, 64, 8, 5, True, False),
    (128, 128, 8, 4, False, False), (128, 128, 8, 4, True, True), (64, 128, 4, 4, True, True),
    (128, 256, 8, 3, True, True), (64, 256, 8, 3, True, False),
]
#: (name, K, N, row counts) of the swept weights: each model's GEMMs as its decode step runs them
#: (q/k/v, gate/up and MLA's first projections fused into one weight each, as fuse_linears does)
SWEEP_SHAPES = [("0.6b qkv", 1024, 4096, (128, 256)), ("0.6b o", 2048, 1024, (128, 256)),
                ("0.6b gate_up", 1024, 6144, (128, 256)), ("0.6b down", 3072, 1024, (128, 256)),
                ("0.6b lm_head", 1024, 151936, (128, 256)),
                ("8b qkv", 4096, 6144, (128, 256)), ("8b o", 4096, 4096, (128, 256)),
                ("8b gate_up", 4096, 24576, (128, 256)), ("8b down", 12288, 4096, (128, 256)),
                ("8b lm_head", 4096, 151936, (128, 256)),
                # DeepSeek-V3 (decode of 16 sequences): q_a + kv_a, q_b, o, shared and dense experts
                ("dsv3 q_a+kv_a", 7168, 2112, (16,)), ("dsv3 q_b", 1536, 24576, (16,)),
                ("dsv3 kv_b (expanded)", 512, 32768, (16,)), ("dsv3 o", 16384, 7168, (16,)),
                ("dsv3 shared gate_up", 7168, 4096, (16,)), ("dsv3 shared down", 2048, 7168, (16,)),
                ("dsv3 dense gate_up", 7168, 36864, (16,)), ("dsv3 dense down", 18432, 7168, (16,)),
                ("dsv3 lm_head", 7168, 129280, (16,)),
                # Moonlight (no q-LoRA, 16 heads of 192/128, 2 shared experts of 1408)
                ("moonlight q+kv_a", 2048, 3648, (128, 256)), ("moonlight kv_b (expanded)", 512, 4096, (128, 256)),
                ("moonlight o", 2048, 2048, (128, 256)), ("moonlight shared gate_up", 2048, 5632, (128, 256)),
                ("moonlight shared down", 2816, 2048, (128, 256)), ("moonlight lm_head", 2048, 163840, (128, 256))]


def _candidates(m: int) -> list[tuple]:
    if m <= 64:
        return SMALL_M_CANDIDATES
    return MID_M_CANDIDATES if m <= 256 else LARGE_M_CANDIDATES if m < 4096 else LARGE_M_CANDIDATES[:5]


def sweep_linear(hbm: float, shapes: str = "", ms: tuple[int, ...] | None = None) -> None:
    """Time every candidate tile config (to choose pick_config) on the weights whose name contains
    `shapes` (all when empty) at their decode row counts (or `ms`), inside CUDA graphs over
    rotating weight copies (`bench_graph`): the GPU time of a decode step's launch, weights read
    from HBM. "same bits" compares each candidate's output with that of the config pick_config
    picks (marked *); they must be equal (rule 1)."""
    from vexact_models.kernels.linear import LinearConfig, linear_triton, pick_config

    rows, different = [], 0
    for name, k, n, shape_ms in (s for s in SWEEP_SHAPES if shapes in s[0]):
        weights = rotating_copies((torch.randn(n, k, device="cuda") / k ** 0.5).bfloat16())
        for m in ms or shape_ms:
            x = torch.randn(m, k, device="cuda").bfloat16()
            t_cublas = bench_graph([lambda w=w: torch.matmul(x, w.t()) for w in weights])
            picked = pick_config(m, n, k, torch.bfloat16)
            want = linear_triton(x, weights[0], None, torch.bfloat16, picked)
            cands = [(c.block_m, c.block_n, c.num_warps, c.num_stages, c.tma, c.persistent) for c in [picked]]
            cands += [c for c in _candidates(m) if c != cands[0]]
            best = None
            for bm, bn, warps, stages, tma, persistent in cands:
                cfg = LinearConfig(bm, bn, warps, stages, tma=tma, persistent=persistent)
                try:
                    same = torch.equal(linear_triton(x, weights[0], None, torch.bfloat16, cfg), want)
                    t = bench_graph([lambda w=w: linear_triton(x, w, None, torch.bfloat16, cfg) for w in weights])
                except Exception as exc:  # a config that does not compile (shared memory) is skipped
                    print(f"  skip {cfg}: {type(exc).__name__}")
                    continue
                different += not same
                if best is None or t < best[0]:
                    best = (t, cfg)
                nbytes = 2 * (m * k + n * k + m * n)
                label = f"{bm}x{bn} w{warps} s{stages}{' tma' if tma else ''}{' pers' if persistent else ''}"
                rows.append([name, m, label + (" *" if cfg == picked else ""), f"{t * 1e3:.1f}",
                             f"{t_cublas * 1e3:.1f}", f"{t_cublas / t:.2f}", f"{2 * m * n * k / t / 1e9:.0f}",
                             f"{100 * nbytes / t / 1e6 / hbm:.0f}%", "yes" if same else "NO"])
            print(f"best {name} M={m}: {best[1]} {best[0] * 1e3:.1f}us (picked {picked}; cuBLAS {t_cublas * 1e3:.1f}us)")
        del weights
    table("linear config sweep (* = pick_config's choice; CUDA graphs, weights from HBM)",
          ["shape", "M", "config", "us", "cuBLAS us", "ratio", "TFLOP/s", "% HBM", "same bits"], rows)
    print(f"configs whose output differs from the picked one: {different}")


def bench_attention(hbm: float, quick: bool) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from vexact_models.kernels import UnsupportedError, attention, attention_packed
    from vexact_models.kernels.attention_backward_choice import use_attention_backward

    rows = []
    for hq, hkv, d in ((16, 8, 128), (32, 8, 128)):
        for batch, seqlen in ((16, 1024), (4, 4096), (1, 8192), (1, 32768)):
            t = batch * seqlen
            q = torch.randn(t, hq, d, device="cuda").bfloat16()
            k = torch.randn(t, hkv, d, device="cuda").bfloat16()
            v = torch.randn(t, hkv, d, device="cuda").bfloat16()
            cu = torch.arange(0, t + 1, seqlen, dtype=torch.int32, device="cuda")
            t_ours = bench(lambda: attention_packed(q, k, v, cu, seqlen))
            qs = q.view(batch, seqlen, hq, d).transpose(1, 2)
            ks = k.view(batch, seqlen, hkv, d).transpose(1, 2)
            vs = v.view(batch, seqlen, hkv, d).transpose(1, 2)
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                kr, vr = ks.repeat_interleave(hq // hkv, 1), vs.repeat_interleave(hq // hkv, 1)
                t_sdpa = bench(lambda: torch.nn.functional.scaled_dot_product_attention(qs, kr, vr, is_causal=True))
            flops = 2 * 2 * batch * hq * seqlen * seqlen * d / 2
            rows.append([f"{hq}/{hkv}x{d}", batch, seqlen, f"{t_ours * 1e3:.0f}", f"{t_sdpa * 1e3:.0f}",
                         f"{flops / t_ours / 1e9:.0f}", f"{flops / t_sdpa / 1e9:.0f}", f"{t_sdpa / t_ours:.2f}"])
            # backward: each kernel forced on our forward's out/lse (kernels/attention_backward_choice.py)
            qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
            out = attention_packed(qg, kg, vg, cu, seqlen)
            go = torch.randn_like(out)
            qsg, krg, vrg = (x.detach().clone().requires_grad_() for x in (qs, kr, vr))
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                o2 = torch.nn.functional.scaled_dot_product_attention(qsg, krg, vrg, is_causal=True)
                go2 = torch.randn_like(o2)
                t_bwd_sdpa = bench(lambda: torch.autograd.grad(o2, (qsg, krg, vrg), go2, retain_graph=True))
            for mode in ("triton", "flash", "cudnn", "fa4"):
                try:
                    with use_attention_backward(mode):
                        t_bwd = bench(lambda: torch.autograd.grad(out, (qg, kg, vg), go, retain_graph=True))
                except UnsupportedError:
                    rows.append([f"  bwd {mode}", batch, seqlen, "n/a", f"{t_bwd_sdpa * 1e3:.0f}", "n/a",
                                 f"{2.5 * flops / t_bwd_sdpa / 1e9:.0f}", "n/a"])
                    continue
                rows.append([f"  bwd {mode}", batch, seqlen, f"{t_bwd * 1e3:.0f}", f"{t_bwd_sdpa * 1e3:.0f}",
                             f"{2.5 * flops / t_bwd / 1e9:.0f}", f"{2.5 * flops / t_bwd_sdpa / 1e9:.0f}",
                             f"{t_bwd_sdpa / t_bwd:.2f}"])
            if quick:
                break
    table("attention prefill/training (causal, packed) vs SDPA flash", ["heads", "batch", "seqlen", "ours us",
          "SDPA us", "ours TFLOP/s", "SDPA TFLOP/s", "ratio"], rows)

    rows = []
    for hq, hkv, d in ((16, 8, 128), (32, 8, 128)):
        for batch, ctx in ((64, 1024), (128, 2048), (256, 1024), (32, 8192)):
            page = 16
            k_cache = torch.randn(batch * (ctx // page), page, hkv, d, device="cuda").bfloat16()
            v_cache = torch.randn_like(k_cache)
            layout = decode_layout(batch, ctx, page)
            q = torch.randn(batch, hq, d, device="cuda").bfloat16()
            t_ours = bench(lambda: attention(q, k_cache, v_cache, layout))
            kc = k_cache.view(batch, ctx, hkv, d).transpose(1, 2).repeat_interleave(hq // hkv, 1)
            vc = v_cache.view(batch, ctx, hkv, d).transpose(1, 2).repeat_interleave(hq // hkv, 1)
            qs = q.view(batch, 1, hq, d).transpose(1, 2)
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                t_sdpa = bench(lambda: torch.nn.functional.scaled_dot_product_attention(qs, kc, vc))
            kv_bytes = 2 * batch * ctx * hkv * d * 2
            rows.append([f"{hq}/{hkv}x{d}", batch, ctx, f"{t_ours * 1e3:.0f}", f"{t_sdpa * 1e3:.0f}",
                         f"{kv_bytes / t_ours / 1e6:.0f}", f"{100 * kv_bytes / t_ours / 1e6 / hbm:.0f}%",
                         f"{t_sdpa / t_ours:.2f}"])
            if quick:
                break
    table("decode attention (paged, page 16) vs SDPA flash on contiguous KV (KV bytes / time)",
          ["heads", "batch", "context", "ours us", "SDPA us", "ours GB/s", "% HBM", "ratio"], rows)


def bench_rows(hbm: float, quick: bool) -> None:
    from vexact_models.kernels import gather_logprobs, log_softmax, rms_norm, silu_and_mul

    rows = []
    for m, n in ((4096, 1024), (4096, 4096), (65536, 128)):
        x = torch.randn(m, n, device="cuda").bfloat16()
        w = torch.rand(n, device="cuda").bfloat16()
        t_ours = bench_graph([lambda: rms_norm(x, w, 1e-6)])
        t_torch = bench_graph([lambda: torch.nn.functional.rms_norm(x, (n,), w, 1e-6)])
        nbytes = 2 * 2 * m * n
        rows.append(["rms_norm", f"{m}x{n}", f"{t_ours * 1e3:.1f}", f"{t_torch * 1e3:.1f}",
                     f"{nbytes / t_ours / 1e6:.0f}", f"{100 * nbytes / t_ours / 1e6 / hbm:.0f}%", f"{t_torch / t_ours:.2f}"])
    for m in (64, 128, 256, 1024, 4096):  # decode steps' rows, then training's
        x = torch.randn(m, 151936, device="cuda")
        t_ours = bench_graph([lambda: log_softmax(x, 1.0)])
        t_torch = bench_graph([lambda: torch.log_softmax(x, -1)])
        nbytes = 2 * 4 * x.numel()
        rows.append(["log_softmax", f"{m}x151936", f"{t_ours * 1e3:.1f}", f"{t_torch * 1e3:.1f}",
                     f"{nbytes / t_ours / 1e6:.0f}", f"{100 * nbytes / t_ours / 1e6 / hbm:.0f}%", f"{t_torch / t_ours:.2f}"])
        tgt = torch.randint(0, 151936, (m,), device="cuda")
        t_g = bench_graph([lambda: gather_logprobs(x, tgt, 1.0)])
        t_tg = bench_graph([lambda: torch.log_softmax(x, -1).gather(1, tgt[:, None])])
        rows.append(["gather_logprobs", f"{m}x151936", f"{t_g * 1e3:.1f}", f"{t_tg * 1e3:.1f}",
                     f"{4 * x.numel() / t_g / 1e6:.0f}", f"{100 * 4 * x.numel() / t_g / 1e6 / hbm:.0f}%", f"{t_tg / t_g:.2f}"])
    for m, n in ((4096, 3072), (4096, 12288)):
        g, u = torch.randn(m, n, device="cuda").bfloat16(), torch.randn(m, n, device="cuda").bfloat16()
        t_ours = bench_graph([lambda: silu_and_mul(g, u)])
        t_torch = bench_graph([lambda: torch.nn.functional.silu(g) * u])
        nbytes = 3 * 2 * m * n
        rows.append(["silu_and_mul", f"{m}x{n}", f"{t_ours * 1e3:.1f}", f"{t_torch * 1e3:.1f}",
                     f"{nbytes / t_ours / 1e6:.0f}", f"{100 * nbytes / t_ours / 1e6 / hbm:.0f}%", f"{t_torch / t_ours:.2f}"])
    rows += _rotary_rows(hbm)
    table("row and element-wise kernels vs torch (rotary_cache_write: vs our separate ops)",
          ["op", "shape", "ours us", "torch us", "ours GB/s", "% HBM", "ratio"], rows)


def _rotary_rows(hbm: float) -> list[list]:
    """apply_rotary beside torch's formula, and the rollout's fused q/k norm + rotary + KV cache
    write beside the separate ops it replaces (the peer column), at Qwen3-8B heads (32/8, D=128),
    timed inside CUDA graphs (`bench_graph`: these kernels take microseconds, the host launch more)."""
    from vexact_models.kernels import apply_rotary, rope_table, rotary_cache_write
    from vexact_models.kernels.rotary_cache_write import rotary_cache_write_reference

    cos, sin = (t.cuda() for t in rope_table(1.0 / (1e6 ** (torch.arange(0, 128, 2) / 128)), 8192))
    out = []
    for tokens in (128, 256, 4096):
        qkv = torch.randn(tokens, 48 * 128, device="cuda").bfloat16()
        q, k, v = (t.view(tokens, -1, 128) for t in qkv.split([4096, 1024, 1024], dim=1))
        pos = torch.randint(0, 8192, (tokens,), device="cuda")
        caches = [torch.zeros(tokens, 1, 8, 128, device="cuda").bfloat16() for _ in range(2)]
        slots = torch.randperm(tokens, device="cuda")
        wq, wk = (torch.rand(128, device="cuda") + 0.5).bfloat16(), (torch.rand(128, device="cuda") + 0.5).bfloat16()
        qc = q.contiguous()
        c, s_ = cos[pos][:, None, :], sin[pos][:, None, :]

        def torch_rotary():
            x1, x2 = qc[..., :64].float(), qc[..., 64:].float()
            return torch.cat([x1 * c - x2 * s_, x2 * c + x1 * s_], -1).bfloat16()

        t_ours, t_torch = bench_graph([lambda: apply_rotary(qc, pos, cos, sin)]), bench_graph([torch_rotary])
        nbytes = 2 * 2 * qc.numel()
        out.append(["apply_rotary", f"{tokens}x32x128", f"{t_ours * 1e3:.1f}", f"{t_torch * 1e3:.1f}",
                    f"{nbytes / t_ours / 1e6:.0f}", f"{100 * nbytes / t_ours / 1e6 / hbm:.0f}%", f"{t_torch / t_ours:.2f}"])
        t_fused = bench_graph([lambda: rotary_cache_write(q, k, v, pos, cos, sin, *caches, slots, wq, wk)])
        t_apart = bench_graph([lambda: rotary_cache_write_reference(q, k, v, pos, cos, sin, *caches, slots, wq, wk)])
        nbytes = 2 * 2 * qkv.numel()
        out.append(["rotary_cache_write", f"{tokens} tok 32/8x128", f"{t_fused * 1e3:.1f}", f"{t_apart * 1e3:.1f}",
                    f"{nbytes / t_fused / 1e6:.0f}", f"{100 * nbytes / t_fused / 1e6 / hbm:.0f}%", f"{t_apart / t_fused:.2f}"])
    return out


#: (lanes, columns per chunk, warps) candidates of `log_softmax`'s chunked grid; lanes and chunk set
#: the bits (a chunk's (max, sum) pair), warps only the schedule
LOG_SOFTMAX_CANDIDATES = ((512, 16384, 4), (512, 16384, 8), (1024, 16384, 4), (1024, 16384, 8),
                          (1024, 32768, 4), (2048, 32768, 4), (2048, 32768, 8), (1024, 8192, 4))


def sweep_log_softmax(hbm: float) -> None:
    """`gather_logprobs` under each `LOG_SOFTMAX_CANDIDATES` entry (module constants swapped for the
    call) at decode and training row counts, beside torch's log_softmax + gather: microseconds, GB/s
    of the logits read, the time relative to the kept config, and whether the bits equal those of
    the first candidate of the same lanes and chunk (they must: warps do not change them)."""
    lsm = importlib.import_module("vexact_models.kernels.log_softmax")  # the module (the package exports the op)
    kept = (lsm.BLOCK_V, lsm.CHUNK_COLUMNS, lsm._NUM_WARPS)
    out = []
    for m in (64, 128, 256, 1024, 4096):
        copies = rotating_copies(torch.randn(m, 151936, device="cuda") * 3)
        tgt = torch.randint(0, 151936, (m,), device="cuda")
        t_torch = bench_graph([lambda c=c: torch.log_softmax(c, -1).gather(1, tgt[:, None]) for c in copies], reps=4)
        first, times = {}, {}
        for cand in (kept, *[c for c in LOG_SOFTMAX_CANDIDATES if c != kept]):
            lsm.BLOCK_V, lsm.CHUNK_COLUMNS, lsm._NUM_WARPS = cand
            times[cand] = bench_graph([lambda c=c: lsm.gather_logprobs(c, tgt, 1.0) for c in copies], reps=4)
            bits = lsm.gather_logprobs(copies[0], tgt, 1.0)
            same = torch.equal(bits, first.setdefault(cand[:2], bits))
            out.append([m, f"{cand[0]} lanes x {cand[1]}, {cand[2]} warps" + (" (kept)" if cand == kept else ""),
                        f"{times[cand] * 1e3:.1f}", f"{m * 151936 * 4 / times[cand] / 1e6:.0f}",
                        f"{times[cand] / times[kept]:.2f}", f"{t_torch / times[cand]:.2f}", "yes" if same else "NO"])
        lsm.BLOCK_V, lsm.CHUNK_COLUMNS, lsm._NUM_WARPS = kept
    table(f"gather_logprobs candidates, rows x 151,936 fp32 logits (copy bandwidth {hbm:.0f} GB/s)",
          ["rows", "chunked grid", "us", "GB/s", "time / kept", "torch / ours", "same bits"], out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=["linear", "attention", "rows"])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--sweep-linear", action="store_true", help="time every linear tile config candidate")
    parser.add_argument("--sweep-shapes", default="", help="with --sweep-linear: only weights whose name contains this")
    parser.add_argument("--sweep-log-softmax", action="store_true",
                        help="time gather_logprobs under each chunked-grid candidate (lanes, chunk, warps)")
    parser.add_argument("--sweep-m", default="",
                        help="with --sweep-linear: comma-separated row counts (default: each weight's decode batches)")
    args = parser.parse_args(argv)
    try:
        sweep_ms = tuple(int(m) for m in args.sweep_m.split(",")) if args.sweep_m else None
    except ValueError:
        parser.error(f"--sweep-m {args.sweep_m!r}: expected comma-separated integers, e.g. 16,256")
    if sweep_ms and min(sweep_ms) < 1:
        parser.error(f"--sweep-m {args.sweep_m!r}: row counts must be >= 1")
    if not torch.cuda.is_available():
        print("benchmarks/kernel_peers.py needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    hbm = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; measured copy bandwidth {hbm:.0f} GB/s")
    if args.sweep_linear:
        sweep_linear(hbm, args.sweep_shapes, sweep_ms)
        return 0
    if args.sweep_log_softmax:
        sweep_log_softmax(hbm)
        return 0
    if args.only in (None, "linear"):
        bench_linear(hbm, args.quick)
    if args.only in (None, "attention"):
        bench_attention(hbm, args.quick)
    if args.only in (None, "rows"):
        bench_rows(hbm, args.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
