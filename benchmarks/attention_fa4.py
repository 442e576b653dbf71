"""FlashAttention-4 (`flash-attn-4`, ``flash_attn.cute``) as a candidate attention backend
(docs/design.md rule 2 and section 9): is it faster than ours, and can it be aligned?

A backend can serve the rollout engine and training only if one call pattern gives bitwise the
same output rows whichever way a sequence reaches it (docs/design.md rule 2). This script runs,
for FA4 and for our kernel (the control, which must show 0):

- alignment: random sequences of uneven lengths (GQA, D=128, bf16); the rows of a packed training
  call (varlen, causal) are compared bitwise with the same sequence computed alone, with chunked
  prefill through a paged cache (page 16, pages shuffled) and with decode, one query per
  sequence per call over the paged cache. FA4 runs with ``num_splits=1`` (split-KV would change
  the reduction order by construction);
- speed: causal packed attention forward and backward at the `kernel_peers.py` training shapes (16 and
  32 query heads over 8 KV heads, 16 x 1k, 4 x 4k, 8k, 32k tokens), FA4 beside ours and torch SDPA
  flash, and paged decode (page 16) beside ours.

FA4 is not a dependency: the script reports what it cannot import. Usage (CUDA only):
``cd benchmarks && python3 attention_fa4.py [--quick] [--skip-speed] [--skip-alignment]``.
"""

from __future__ import annotations

import argparse
import sys

import torch

from bench_utils import bench, bench_graph, decode_layout, table

PAGE = 16


def fa4():
    """The FA4 varlen entry point, or None (the import error printed)."""
    try:
        from flash_attn.cute import flash_attn_varlen_func
    except Exception as exc:  # noqa: BLE001 - any import failure means "not available here"
        print(f"flash_attn.cute not importable: {type(exc).__name__}: {exc}")
        return None
    return flash_attn_varlen_func


def fa4_out(result):
    """FA4 returns ``out`` or ``(out, lse)`` depending on the release."""
    return result[0] if isinstance(result, tuple) else result


# --- the four ways a sequence reaches attention -------------------------------------------------

def paged_cache(k: torch.Tensor, v: torch.Tensor, lens: list[int], page: int = PAGE):
    """Each sequence's keys and values written into shuffled pages of one cache ``[pages, page,
    Hkv, D]``; returns (k_cache, v_cache, page table ``[S, max pages]`` int32). Unused slots hold
    finite values (FA4's TMA path reads whole pages)."""
    pages_per = [-(-n // page) for n in lens]
    total = sum(pages_per)
    perm = torch.randperm(total, device=k.device, dtype=torch.int32)
    k_cache = torch.randn(total, page, *k.shape[1:], device=k.device, dtype=k.dtype)
    v_cache = torch.randn(total, page, *v.shape[1:], device=v.device, dtype=v.dtype)
    table_ = torch.zeros(len(lens), max(pages_per), dtype=torch.int32, device=k.device)
    start, page0 = 0, 0
    for s, n in enumerate(lens):
        pages = perm[page0:page0 + pages_per[s]]
        table_[s, :len(pages)] = pages
        for j in range(pages_per[s]):
            rows = slice(start + j * page, start + min((j + 1) * page, n))
            count = rows.stop - rows.start
            k_cache[pages[j], :count] = k[rows]
            v_cache[pages[j], :count] = v[rows]
        start, page0 = start + n, page0 + pages_per[s]
    return k_cache, v_cache, table_


class Fa4Paths:
    """FA4 called as training, prefill and decode would call it."""

    def __init__(self, fn):
        self.fn = fn

    def packed(self, q, k, v, cu, max_len):
        return fa4_out(self.fn(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max_len,
                               max_seqlen_k=max_len, causal=True, num_splits=1))

    def paged(self, q, k_cache, v_cache, cu_q, max_q, seen, table_):
        """`q` rows ``cu_q`` of each sequence are its last tokens of ``seen`` (context + new)."""
        return fa4_out(self.fn(q, k_cache, v_cache, cu_seqlens_q=cu_q, max_seqlen_q=max_q, seqused_k=seen,
                               page_table=table_, causal=True, num_splits=1))


class OurPaths:
    """Our kernel called the same ways (the control)."""

    def packed(self, q, k, v, cu, max_len):
        from vexact_models.kernels import attention_packed

        return attention_packed(q, k, v, cu, max_len)

    def paged(self, q, k_cache, v_cache, cu_q, max_q, seen, table_):
        from vexact_models.kernels import PagedLayout, attention

        return attention(q, k_cache, v_cache, PagedLayout(cu_q, seen, table_, k_cache.shape[1], max_q))


def mismatches(a: torch.Tensor, b: torch.Tensor) -> tuple[int, float]:
    """Elements that differ in bits, and the largest absolute difference."""
    differ = a.view(torch.int16) != b.view(torch.int16)
    return int(differ.sum()), float((a.float() - b.float()).abs().max())


def alignment_rows(name: str, paths, lens: list[int], heads: tuple[int, int], dims: tuple[int, int], chunk: int,
                   page: int = PAGE, dev: str = "cuda") -> list[list]:
    """Compare every way a sequence reaches attention with the packed training call: rows of
    ``[kernel, path, elements, mismatches, max |diff|]``."""
    (hq, hkv), (d, dv) = heads, dims
    total = sum(lens)
    q = torch.randn(total, hq, d, device=dev).bfloat16()
    k = torch.randn(total, hkv, d, device=dev).bfloat16()
    v = torch.randn(total, hkv, dv, device=dev).bfloat16()
    starts = [sum(lens[:i]) for i in range(len(lens))]
    cu = torch.tensor(starts + [total], dtype=torch.int32, device=dev)
    ref = paths.packed(q, k, v, cu, max(lens))
    elements, rows = ref.numel(), []

    alone = torch.cat([paths.packed(q[s:s + n], k[s:s + n], v[s:s + n],
                                    torch.tensor([0, n], dtype=torch.int32, device=dev), n)
                       for s, n in zip(starts, lens)])
    rows.append([name, "each sequence alone", elements, *mismatches(alone, ref)])

    k_cache, v_cache, table_ = paged_cache(k, v, lens, page)
    prefill = torch.empty_like(ref)
    for c0 in range(0, max(lens), chunk):  # chunk c of every sequence still running, in one call
        live = [s for s, n in enumerate(lens) if n > c0]
        sizes = [min(chunk, lens[s] - c0) for s in live]
        idx = torch.cat([torch.arange(starts[s] + c0, starts[s] + c0 + m, device=dev) for s, m in zip(live, sizes)])
        cu_q = torch.tensor([0] + list(torch.tensor(sizes).cumsum(0)), dtype=torch.int32, device=dev)
        seen = torch.tensor([c0 + m for m in sizes], dtype=torch.int32, device=dev)
        prefill[idx] = paths.paged(q[idx], k_cache, v_cache, cu_q, max(sizes), seen, table_[live])
    rows.append([name, f"chunked prefill ({chunk}-token chunks, page {page})", elements, *mismatches(prefill, ref)])

    decode = torch.empty_like(ref)
    for p in range(max(lens)):  # position p of every sequence that has one, one query each
        live = [s for s, n in enumerate(lens) if n > p]
        idx = torch.tensor([starts[s] + p for s in live], device=dev)
        cu_q = torch.arange(len(live) + 1, dtype=torch.int32, device=dev)
        seen = torch.full((len(live),), p + 1, dtype=torch.int32, device=dev)
        decode[idx] = paths.paged(q[idx], k_cache, v_cache, cu_q, 1, seen, table_[live])
    rows.append([name, f"decode (one query per call, page {page})", elements, *mismatches(decode, ref)])
    return rows


#: (query heads, KV heads), (key dim, value dim), prefill chunk, page size: Qwen3-0.6B and -8B
#: attention, and the expanded MLA shape of Moonlight / DeepSeek-V3 (qk 192 = 128 nope + 64 rope)
ALIGNMENT_CASES = (((16, 8), (128, 128), 100, 16), ((32, 8), (128, 128), 100, 16), ((32, 8), (128, 128), 37, 128),
                   ((16, 16), (192, 128), 100, 16), ((16, 16), (192, 128), 512, 128))


def check_alignment(fn, quick: bool) -> None:
    torch.manual_seed(0)
    lens = [777, 1500, 64, 1029, 1] if not quick else [300, 129]
    rows = []
    for heads, dims, chunk, page in ALIGNMENT_CASES[:2 if quick else None]:
        for name, paths in (("ours", OurPaths()), ("FA4", Fa4Paths(fn) if fn else None)):
            if paths is None:
                continue
            for row in alignment_rows(name, paths, lens, heads, dims, chunk, page):
                rows.append([f"{heads[0]}/{heads[1]}", f"{dims[0]}/{dims[1]}", *row])
    table(f"alignment with the packed training call (sequences {lens}, bf16)",
          ["heads", "dims", "kernel", "path", "elements", "mismatches", "max |diff|"], rows)


# --- speed ----------------------------------------------------------------------------------------

def time_backward(out: torch.Tensor, inputs) -> float:
    go = torch.randn_like(out)
    return bench(lambda: torch.autograd.grad(out, inputs, go, retain_graph=True))


def bench_training(fn, quick: bool) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from vexact_models.kernels import attention_packed

    rows = []
    for hq, hkv in ((16, 8), (32, 8)):
        for batch, seqlen in ((16, 1024), (4, 4096), (1, 8192), (1, 32768)):
            t, d = batch * seqlen, 128
            q, k, v = (torch.randn(t, h, d, device="cuda").bfloat16().requires_grad_() for h in (hq, hkv, hkv))
            cu = torch.arange(0, t + 1, seqlen, dtype=torch.int32, device="cuda")
            qs, ks, vs = (x.detach().view(batch, seqlen, -1, d).transpose(1, 2) for x in (q, k, v))
            ks, vs = (x.repeat_interleave(hq // hkv, 1).requires_grad_() for x in (ks, vs))
            qs.requires_grad_()
            flops = 2 * batch * hq * seqlen * seqlen * d  # causal: half of 4 * b * h * s^2 * d
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True)  # noqa: E731
                fwd = {"SDPA flash": bench(sdpa)}
                bwd = {"SDPA flash": time_backward(sdpa(), (qs, ks, vs))}
            fwd["ours"] = bench(lambda: attention_packed(q, k, v, cu, seqlen))
            bwd["ours"] = time_backward(attention_packed(q, k, v, cu, seqlen), (q, k, v))
            if fn is not None:
                paths = Fa4Paths(fn)
                fwd["FA4"] = bench(lambda: paths.packed(q, k, v, cu, seqlen))
                bwd["FA4"] = time_backward(paths.packed(q, k, v, cu, seqlen), (q, k, v))
            for name in fwd:
                rows.append([f"{hq}/{hkv}", f"{batch}x{seqlen}", name, f"{fwd[name] * 1e3:.0f}",
                             f"{flops / fwd[name] / 1e9:.0f}", f"{fwd['SDPA flash'] / fwd[name]:.2f}",
                             f"{bwd[name] * 1e3:.0f}", f"{2.5 * flops / bwd[name] / 1e9:.0f}",
                             f"{bwd['SDPA flash'] / bwd[name]:.2f}"])
            if quick:
                break
    table("causal packed attention, D=128, bf16: forward and backward (our backward: the default choice)",
          ["heads", "tokens", "kernel", "fwd us", "fwd TFLOP/s", "fwd vs SDPA", "bwd us", "bwd TFLOP/s",
           "bwd vs SDPA"], rows)


def bench_decode(fn, quick: bool) -> None:
    """Paged decode attention inside CUDA graphs (as the engine replays it; `bench_graph`), the
    KV pages shuffled, at pages of 16 (the engine's default) and 128 (FA4's TMA page)."""
    from vexact_models.kernels import attention

    rows = []
    for hq, hkv in ((16, 8), (32, 8)):
        for batch, ctx in ((128, 512), (256, 512), (256, 1024), (32, 8192)):
            q = torch.randn(batch, hq, 128, device="cuda").bfloat16()
            times = {}
            for page in (16, 128):
                k_cache = torch.randn(batch * (ctx // page), page, hkv, 128, device="cuda").bfloat16()
                v_cache = torch.randn_like(k_cache)
                layout = decode_layout(batch, ctx, page)
                times[f"ours, page {page}"] = bench_graph([lambda: attention(q, k_cache, v_cache, layout)])
                if fn is not None:
                    paths = Fa4Paths(fn)
                    call = lambda: paths.paged(q, k_cache, v_cache, layout.cu_seqlens_q, 1,  # noqa: E731
                                               layout.seq_lens, layout.block_table)
                    try:
                        times[f"FA4, page {page}"] = bench_graph([call])
                    except RuntimeError as exc:  # report it, and time host launches instead
                        print(f"FA4 in a CUDA graph failed ({exc}); timing launches")
                        times[f"FA4, page {page}, launches"] = bench(call)
            kv_bytes = 2 * batch * ctx * hkv * 128 * 2
            for name, ms in times.items():
                rows.append([f"{hq}/{hkv}", batch, ctx, name, f"{ms * 1e3:.0f}", f"{kv_bytes / ms / 1e6:.0f}",
                             f"{times['ours, page 16'] / ms:.2f}"])
            if quick:
                break
    table("decode attention in CUDA graphs (paged, pages shuffled; FA4 with num_splits=1)",
          ["heads", "batch", "context", "kernel", "us", "KV GB/s", "vs ours page 16"], rows)


def host_overhead(fn) -> None:
    """Host time of one call (no GPU wait): what an eager step pays per attention layer."""
    import time

    q = torch.randn(256, 16, 128, device="cuda").bfloat16()
    k_cache = torch.randn(256 * 32, 16, 8, 128, device="cuda").bfloat16()
    layout = decode_layout(256, 512, 16)
    from vexact_models.kernels import attention

    calls = {"ours": lambda: attention(q, k_cache, k_cache, layout)}
    if fn is not None:
        paths = Fa4Paths(fn)
        calls["FA4"] = lambda: paths.paged(q, k_cache, k_cache, layout.cu_seqlens_q, 1, layout.seq_lens,
                                           layout.block_table)
    rows = []
    for name, call in calls.items():
        call()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(200):
            call()
        rows.append([name, f"{(time.perf_counter() - t0) / 200 * 1e6:.0f}"])
        torch.cuda.synchronize()
    table("host time per decode attention call (batch 256, context 512)", ["kernel", "us"], rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one shape per table, short sequences")
    parser.add_argument("--skip-speed", action="store_true", help="alignment checks only")
    parser.add_argument("--skip-alignment", action="store_true", help="timings only")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("attention_fa4.py needs a CUDA GPU", file=sys.stderr)
        return 2
    fn = fa4()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; FA4 {'available' if fn else 'not available'}")
    if not args.skip_alignment:
        check_alignment(fn, args.quick)
    if not args.skip_speed:
        bench_training(fn, args.quick)
        bench_decode(fn, args.quick)
        host_overhead(fn)
    return 0


if __name__ == "__main__":
    sys.exit(main())
