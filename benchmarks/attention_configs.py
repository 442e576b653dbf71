"""Sweep the attention kernels' launch parameters at the shapes where RL spends its time.

For each case (a decode step over a paged cache, or a packed training forward/backward) every
candidate configuration is timed, and its output is compared bitwise with the first candidate
of the same key block: rows per program, warps, stages and (latent) value chunks must leave every
output element unchanged (docs/design.md rule 2), so "same bits" must read "yes" for all of them;
the key block changes the reduction order, so each key block has its own reference. Backward
candidates are timed only (rule 8: correct, not invariant). Prints one table per case and the
fastest candidate; decode rows give the KV bytes read per second against the measured HBM copy
bandwidth, training rows TFLOP/s beside torch SDPA (its default backend) where SDPA can run the shape.
Latent decode cases that the Gluon kernel takes (`kernels.latent_decode_gluon`, Hopper) add its
rows, at 1, 2, 4 and 8 value chunks, compared with the Triton launches' bits.

Usage:
    python benchmarks/attention_configs.py                   # every case
    python benchmarks/attention_configs.py --only latent     # latent MLA cases only (or: gqa)
    python benchmarks/attention_configs.py --only gqa --cases "train 16x1024" --configs "m128 n64 w4 s2,m64 n64 w4 s3"
"""

from __future__ import annotations

import argparse
import itertools
import sys

import torch

from bench_utils import bench, bench_graph, case_selected, copy_bandwidth, decode_layout, positive_int, table

# (name, kind, heads, kv heads, qk dim, v dim, sequences, tokens per sequence); every name ends in
# "<sequences>x<tokens>" and none is a substring of another, so `--cases` can pick any one case by name
LATENT_CASES = [("moonlight latent decode 256x528", "decode", 16, 1, 576, 512, 256, 528),
                ("deepseek-v3 latent decode 16x272", "decode", 128, 1, 576, 512, 16, 272),
                ("moonlight latent decode 32x4096", "decode", 16, 1, 576, 512, 32, 4096),
                # a rollout's tail: the longest sequences left, one program each (value chunks: more)
                ("moonlight latent decode 8x8192", "decode", 16, 1, 576, 512, 8, 8192),
                ("moonlight latent decode 16x1536", "decode", 16, 1, 576, 512, 16, 1536),
                ("moonlight latent decode 32x1536", "decode", 16, 1, 576, 512, 32, 1536),
                ("moonlight latent decode 64x1536", "decode", 16, 1, 576, 512, 64, 1536),
                ("moonlight latent decode 128x1024", "decode", 16, 1, 576, 512, 128, 1024),
                ("moonlight latent train 8x4096", "train", 16, 1, 576, 512, 8, 4096),
                ("deepseek-v3 latent train 2x4096", "train", 128, 1, 576, 512, 2, 4096)]
GQA_CASES = [("moonlight expanded decode 256x528", "decode", 16, 16, 192, 128, 256, 528),
             ("deepseek-v3 expanded decode 16x272", "decode", 128, 128, 192, 128, 16, 272),
             ("moonlight expanded train 8x4096", "train", 16, 16, 192, 128, 8, 4096),
             ("qwen3-8b decode 128x1024", "decode", 32, 8, 128, 128, 128, 1024),
             ("qwen3-0.6b decode 256x640", "decode", 16, 8, 128, 128, 256, 640),
             # the decode steps of benchmarks/decode_profile.py (512-token prompts, 64 new tokens)
             ("qwen3-8b decode 256x544", "decode", 32, 8, 128, 128, 256, 544),
             ("qwen3-8b decode 128x544", "decode", 32, 8, 128, 128, 128, 544),
             ("qwen3-0.6b decode 256x544", "decode", 16, 8, 128, 128, 256, 544),
             ("qwen3-0.6b decode 128x544", "decode", 16, 8, 128, 128, 128, 544),
             # many-program launches: where TMA page copies might pay (H200, 2026-11-26: 256 x 544)
             ("qwen3-0.6b decode 512x544", "decode", 16, 8, 128, 128, 512, 544),
             ("qwen3-8b decode 256x2048", "decode", 32, 8, 128, 128, 256, 2048),
             # the late steps of a reasoning rollout: few sequences, long contexts
             ("qwen3-8b decode 32x8192", "decode", 32, 8, 128, 128, 32, 8192),
             ("qwen3-8b decode 32x1024", "decode", 32, 8, 128, 128, 32, 1024),
             ("qwen3-8b decode 64x4096", "decode", 32, 8, 128, 128, 64, 4096),
             ("qwen3-8b decode 128x4096", "decode", 32, 8, 128, 128, 128, 4096),
             ("qwen3-0.6b decode 32x8192", "decode", 16, 8, 128, 128, 32, 8192),
             ("qwen3-8b train 4x4096", "train", 32, 8, 128, 128, 4, 4096),
             ("qwen3-0.6b train 16x1024", "train", 16, 8, 128, 128, 16, 1024),
             ("qwen3-8b train 16x1024", "train", 32, 8, 128, 128, 16, 1024)]
PAGE = 16


def latent_candidates(kind: str):
    from vexact_models.kernels.latent_attention import LatentConfig

    rows = [(16, 4), (16, 8), (32, 4), (64, 8)] if kind == "decode" else [(64, 4), (64, 8), (128, 8), (16, 4), (32, 4)]
    chunks = (1, 2, 4, 8) if kind == "decode" else (1,)
    # the key tile is read through the block table: Triton double-buffers such indirect loads
    # only from five stages on (one buffer below), hence the deep candidates
    for bn, (bm, warps), stages, ch in itertools.product((32, 64), rows, (1, 2, 3, 5), chunks):
        yield LatentConfig(bm, bn, warps, stages, ch)


def gqa_candidates(kind: str):
    from vexact_models.kernels.attention import AttentionConfig

    # every row count gives the same bits (the fixed-order row sum), so decode and training each
    # take their fastest
    rows = [(16, 2), (16, 4), (32, 4), (64, 4)] if kind == "decode" else [(64, 4), (64, 8), (128, 8), (128, 4), (32, 4)]
    for (bm, warps), stages in itertools.product(rows, (1, 2, 3, 4, 5) if kind == "decode" else (1, 2, 3, 4)):
        yield AttentionConfig(bm, 64, warps, stages)
        if kind == "decode":  # the program order: a sequence's KV heads side by side
            yield AttentionConfig(bm, 64, warps, stages, heads_fastest=True)
    for bn, (bm, warps) in itertools.product((32, 128), rows[::2]):  # other key blocks, for the record
        yield AttentionConfig(bm, bn, warps, 2)


def make_inputs(kind, heads, kv_heads, d, dv, seqs, length, latent: bool, page: int = PAGE):
    """(q, k_cache, v_cache, layout, bytes of KV read) for one case, bf16 on the GPU."""
    from vexact_models.kernels.attention import packed_layout

    q_len = 1 if kind == "decode" else length
    q = torch.randn(seqs * q_len, heads, d, device="cuda").bfloat16()
    if kind == "train":
        k = torch.randn(seqs * length, kv_heads, d, device="cuda").bfloat16()
        v = k[..., :dv] if latent else torch.randn(seqs * length, kv_heads, dv, device="cuda").bfloat16()
        cu = torch.arange(seqs + 1, device="cuda", dtype=torch.int32) * length
        return q, k, v, packed_layout(cu, length), 0
    pages = -(-length // page)
    k = torch.randn(seqs * pages, page, kv_heads, d, device="cuda").bfloat16()
    v = k[..., :dv] if latent else torch.randn(seqs * pages, page, kv_heads, dv, device="cuda").bfloat16()
    layout = decode_layout(seqs, length, page)
    kv_bytes = seqs * length * kv_heads * (d + (0 if latent else dv)) * 2
    return q, k, v, layout, kv_bytes


def attention_flops(kind, heads, d, dv, seqs, length) -> float:
    q_len = 1 if kind == "decode" else length
    pairs = seqs * (q_len * length - (q_len * (q_len - 1)) // 2)  # causal (query, key) pairs
    return 2.0 * heads * pairs * (d + dv)


def sweep_case(case, latent: bool, hbm: float, keep_configs: tuple[str, ...] = (), page: int = PAGE) -> list[list]:
    from vexact_models.kernels.attention import attention_triton, kv_descriptors_fit
    from vexact_models.kernels.attention import page_descriptors_fit as gqa_page_fit
    from vexact_models.kernels.latent_attention import latent_attention_triton, page_descriptors_fit

    name, kind, heads, kv_heads, d, dv, seqs, length = case
    q, k, v, layout, kv_bytes = make_inputs(kind, heads, kv_heads, d, dv, seqs, length, latent, page)
    scale = d ** -0.5
    flops = attention_flops(kind, heads, d, dv, seqs, length)

    tma = kind == "train" and not latent and kv_descriptors_fit(k, v)  # as training reads packed K/V
    # decode over pages of whole key blocks: each candidate by pointer loads and by TMA
    rows_per_seq = heads // kv_heads * layout.max_seqlen_q
    flat_k = k.reshape(-1, kv_heads, d)
    page_tma = kind == "decode" and (
        page_descriptors_fit(flat_k, layout.page_size, dv, rows_per_seq) if latent
        else gqa_page_fit(flat_k, v.reshape(-1, kv_heads, dv), layout.page_size, rows_per_seq))

    def run(cfg, by_tma=False):
        if latent:
            return latent_attention_triton(q, k, dv, layout, scale, cfg, kv_descriptors=by_tma)[0]
        return attention_triton(q, k, v, layout, scale, cfg, kv_descriptors=tma, page_descriptors=by_tma)[0]

    rows, refs, best = [], {}, None
    candidates = (latent_candidates if latent else gqa_candidates)(kind)
    for cfg, by_tma in ((c, t) for c in candidates for t in ((False, True) if page_tma else (False,))):
        if keep_configs and not _label(cfg).startswith(keep_configs):
            continue
        if by_tma and (cfg.block_m != 16 or layout.page_size % cfg.block_n):
            continue
        try:
            out = run(cfg, by_tma)
            # decode kernels take tens of microseconds: time them in a CUDA graph, without the host
            ms = (bench_graph([lambda: run(cfg, by_tma)]) if kind == "decode"
                  else bench(lambda: run(cfg), warmup=5, rep=20))
        except Exception as exc:  # out of shared memory / registers: not a candidate
            print(f"  {name}: skip {cfg} ({type(exc).__name__})", flush=True)
            continue
        ref = refs.setdefault(cfg.block_n, out)
        same = "yes" if torch.equal(out, ref) else "NO"
        rate = f"{kv_bytes / ms / 1e6 / hbm * 100:.0f}% HBM" if kind == "decode" else f"{flops / ms / 1e9:.0f} TFLOP/s"
        rows.append([name, _label(cfg) + (" TMA K/V" if tma or by_tma else ""), f"{ms * 1e3:.1f}", rate, same])
        # each row as it is measured too: a run cut off by a time limit keeps what it timed
        print(f"  {name}: {' '.join(rows[-1][1:])}", flush=True)
        if best is None or ms < best[0]:
            best = (ms, cfg, by_tma)
    if latent and kind == "decode":
        rows += _gluon_rows(name, q, k, dv, layout, scale, refs.get(64), kv_bytes, hbm)
    if kind == "train" and not latent:
        rows.append([name, "torch SDPA (default backend)", f"{_sdpa_ms(q, k, v, seqs, length) * 1e3:.1f}", "", "-"])
    print(f"best {name}: {_label(best[1])}{' TMA K/V' if best[2] else ''} {best[0] * 1e3:.1f} us", flush=True)
    return rows


def _gluon_rows(name, q, k, dv, layout, scale, ref, kv_bytes, hbm) -> list[list]:
    """The Gluon latent decode launch (`kernels.latent_decode_gluon`), where it fits, as more
    candidate rows (1, 2, 4 and 8 value chunks): time and whether the bits equal the Triton
    launches'."""
    from vexact_models.kernels import latent_decode_gluon

    kv = k.reshape(-1, 1, k.shape[-1])
    if not latent_decode_gluon.fits(q, kv, dv, layout):
        return []
    rows = []
    for chunks in (1, 2, 4, 8):
        run = lambda: latent_decode_gluon.latent_decode_gluon(q, kv, dv, layout, scale, chunks)[0]  # noqa: E731
        ms = bench_graph([run])
        same = "yes" if ref is not None and torch.equal(run(), ref) else "NO"
        label = f"gluon (warpgroup MMAs, key-major) v{chunks} TMA K/V"
        print(f"{label} {name}: {ms * 1e3:.1f} us", flush=True)
        rows.append([name, label, f"{ms * 1e3:.1f}", f"{kv_bytes / ms / 1e6 / hbm * 100:.0f}% HBM", same])
    return rows


def _sdpa_ms(q, k, v, seqs, length) -> float:
    def shaped(x):
        return x.view(seqs, length, x.shape[1], x.shape[2]).transpose(1, 2)
    qs, ks, vs = shaped(q), shaped(k), shaped(v)
    return bench(lambda: torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True),
                 warmup=5, rep=20)


def _label(cfg) -> str:
    chunks = getattr(cfg, "value_chunks", 1)
    return (f"m{cfg.block_m} n{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages}" + (f" v{chunks}" if chunks > 1 else "")
            + (" heads" if getattr(cfg, "heads_fastest", False) else ""))


def sweep_latent_backward(case) -> list[list]:
    """Time the latent backward's (BLOCK_M, BLOCK_N, warps, stages) candidates for dK/dV and dQ."""
    from vexact_models.kernels.latent_attention import latent_attention_triton
    from vexact_models.kernels.latent_attention_backward import DKDV_CONFIG, DQ_CONFIG, latent_attention_backward_triton

    name, kind, heads, kv_heads, d, dv, seqs, length = case
    q, k, _, layout, _ = make_inputs(kind, heads, kv_heads, d, dv, seqs, length, True)
    out, lse = latent_attention_triton(q, k, dv, layout, d ** -0.5)
    g = torch.randn_like(out)
    cu = layout.cu_seqlens_q
    flops = 2.5 * attention_flops(kind, heads, d, dv, seqs, length)  # the FA2 backward's ~2.5x the forward
    cands = [(32, 32, 8, 1), (32, 64, 8, 1), (64, 32, 8, 1), (64, 64, 8, 1), (32, 32, 4, 2), (32, 32, 8, 2),
             (64, 32, 8, 2), (16, 64, 4, 2), (128, 32, 8, 1), (64, 16, 4, 2)]
    rows = []
    for which in ("dkdv", "dq"):
        for cfg in cands:
            kw = {"dkdv_config": cfg, "dq_config": DQ_CONFIG} if which == "dkdv" else \
                {"dkdv_config": DKDV_CONFIG, "dq_config": cfg}
            try:
                ms = bench(lambda: latent_attention_backward_triton(g, q, k, out, lse, cu, length, d ** -0.5, **kw),
                           warmup=3, rep=10)
            except Exception as exc:
                print(f"  {name} backward: skip {which} {cfg} ({type(exc).__name__})", flush=True)
                continue
            rows.append([f"{name} backward", f"{which} {cfg}", f"{ms * 1e3:.1f}", f"{flops / ms / 1e9:.0f} TFLOP/s", "-"])
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=["latent", "gqa"], help="one kernel's cases")
    parser.add_argument("--cases", help="comma-separated substrings of case names to keep (e.g. 'decode')")
    parser.add_argument("--configs", help="comma-separated prefixes of candidate labels to keep (e.g. 'm128 n64 w4 s2'); "
                                          "the latent training cases' backward sweep, another family, is then skipped")
    parser.add_argument("--page-size", type=positive_int, default=PAGE,
                        help=f"positions per page of the decode caches (default {PAGE}; latent decode over pages "
                             "of a multiple of 64 also times each candidate by TMA)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/attention_configs.py needs a CUDA GPU", file=sys.stderr)
        return 2
    hbm = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; copy bandwidth {hbm:.0f} GB/s")
    for latent, cases in ((True, LATENT_CASES), (False, GQA_CASES)):
        if args.only and args.only != ("latent" if latent else "gqa"):
            continue
        for case in cases:
            if not case_selected(case[0], args.cases):
                continue
            rows = sweep_case(case, latent, hbm, tuple(c for c in (args.configs or "").split(",") if c), args.page_size)
            if latent and case[1] == "train" and not args.configs:
                rows += sweep_latent_backward(case)
            table(case[0], ["case", "config", "us", "rate", "same bits"], rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
