"""How fast can a GQA decode step's attention read its KV cache? (docs/design.md section 9)

The decode attention of a Qwen3 step reads every cached key and value once, and runs at ~90% of
the copy bandwidth (H200, 2026-11-28 and 2026-11-29). This script
times launches that do the same reads and (almost) nothing else, at a decode step's shape, beside
the attention itself and torch's copy (the peer):

- ``paged``: one program per (sequence, KV head), 64-key blocks through the block table, each
  key's ``head_dim`` values of one head (256 bytes of a slot row holding every head), as the
  attention kernel reads them; the values only summed;
- ``head-major pages``: the same programs and bytes, but the cache laid out ``[page, kv_head,
  slot, dim]``, so a program's 64-key block is one contiguous 16 KB piece;
- ``attention``: the decode attention launch (`attention_triton`, its own tile choice);
- ``copy``: ``dst.copy_(src)`` of the cache's size (read + written bytes / time).

If the paged reads alone are no faster than the attention, the attention is at its access
pattern's floor, and a faster decode needs another cache layout (the head-major row says by how
much), not another kernel schedule. Usage (CUDA): ``cd benchmarks && python3 investigations/decode_read_floor.py
[--batch 128,256] [--context 544] [--kv-heads 8] [--group 2] [--page-size 64]``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

# bench_utils lives one folder up, in benchmarks/
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_utils import bench_graph, decode_layout, positive_int, positive_ints, table  # noqa: E402


def _kernels():
    """The read kernel (imported lazily: Triton is needed only on the GPU)."""
    from vexact_models.kernels._triton import tl, triton

    @triton.jit
    def paged_read_kernel(k_ptr, v_ptr, out_ptr, table_ptr, seq_lens_ptr, page_size, stride_bt, n_heads,
                          HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_MAJOR: tl.constexpr):
        kv_head = tl.program_id(0)
        seq = tl.program_id(1)
        n_keys = tl.load(seq_lens_ptr + seq)
        d = tl.arange(0, HEAD_DIM)
        acc = tl.zeros((BLOCK_N, HEAD_DIM), tl.float32)
        for start in range(0, n_keys, BLOCK_N):
            pos = start + tl.arange(0, BLOCK_N)
            ok = pos < n_keys
            page = tl.load(table_ptr + seq * stride_bt + pos // page_size, mask=ok, other=0)
            if HEAD_MAJOR:  # [page, kv_head, slot, dim]
                row = (page * n_heads + kv_head) * page_size + pos % page_size
            else:  # [slot, kv_head, dim], as the engine's cache
                row = (page * page_size + pos % page_size) * n_heads + kv_head
            k = tl.load(k_ptr + row[:, None] * HEAD_DIM + d[None, :], mask=ok[:, None], other=0.0)
            v = tl.load(v_ptr + row[:, None] * HEAD_DIM + d[None, :], mask=ok[:, None], other=0.0)
            acc += k.to(tl.float32) + v.to(tl.float32)
        tl.store(out_ptr + seq * n_heads + kv_head, tl.sum(tl.sum(acc, axis=1), axis=0))

    return paged_read_kernel


def read_all(kernel, k, v, layout, kv_heads: int, head_dim: int, head_major: bool) -> torch.Tensor:
    """Every cached key and value of `layout`'s sequences read once, summed per (sequence, head)."""
    batch = layout.seq_lens.shape[0]
    out = torch.empty(batch * kv_heads, device=k.device, dtype=torch.float32)
    kernel[(kv_heads, batch)](k, v, out, layout.block_table, layout.seq_lens, layout.page_size,
                              layout.block_table.stride(0), kv_heads, HEAD_DIM=head_dim, BLOCK_N=64,
                              HEAD_MAJOR=head_major, num_warps=2, num_stages=3,
                              enable_fp_fusion=False)  # sums only: nothing to contract (design.md section 4)
    return out


def measure(batch: int, context: int, kv_heads: int, group: int, head_dim: int, page: int) -> list:
    """One table row: us and GB/s of each launch at `batch` sequences of `context` cached keys."""
    from vexact_models.kernels.attention import attention_triton

    layout = decode_layout(batch, context, page)
    slots = int(layout.block_table.max()) * page + page
    k = torch.randn(slots, kv_heads, head_dim, device="cuda").bfloat16()
    v = torch.randn_like(k)
    q = torch.randn(batch, kv_heads * group, head_dim, device="cuda").bfloat16()
    kernel = _kernels()
    cache_bytes = 2 * batch * context * kv_heads * head_dim * k.element_size()
    times = {
        "paged": bench_graph([lambda: read_all(kernel, k, v, layout, kv_heads, head_dim, False)]),
        "head-major pages": bench_graph([lambda: read_all(kernel, k, v, layout, kv_heads, head_dim, True)]),
        "attention": bench_graph([lambda: attention_triton(q, k, v, layout, head_dim ** -0.5)]),
    }
    src = torch.empty(cache_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_ms = bench_graph([lambda: dst.copy_(src)])
    row = [f"{batch} x {context}", f"{cache_bytes / 1e6:.0f}"]
    for name in ("paged", "head-major pages", "attention"):
        row += [f"{times[name] * 1e3:.1f}", f"{cache_bytes / times[name] / 1e6:.0f}"]
    row += [f"{copy_ms * 1e3:.1f}", f"{2 * cache_bytes / copy_ms / 1e6:.0f}",
            f"{times['attention'] / times['paged']:.2f}", f"{times['paged'] / times['head-major pages']:.2f}"]
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=positive_ints, default="128,256", help="comma-separated sequence counts")
    parser.add_argument("--context", type=positive_int, default=544, help="cached keys per sequence")
    parser.add_argument("--kv-heads", type=positive_int, default=8, help="KV heads (Qwen3-0.6B and 8B: 8)")
    parser.add_argument("--group", type=positive_int, default=2, help="query heads per KV head (0.6B: 2, 8B: 4)")
    parser.add_argument("--head-dim", type=positive_int, default=128)
    parser.add_argument("--page-size", type=positive_int, default=64, help="cache slots per page")
    args = parser.parse_args(argv)
    if args.page_size & (args.page_size - 1):
        parser.error(f"--page-size {args.page_size}: must be a power of two")
    if not torch.cuda.is_available():
        print("benchmarks/investigations/decode_read_floor.py needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    rows = [measure(b, args.context, args.kv_heads, args.group, args.head_dim, args.page_size) for b in args.batch]
    table(f"{torch.cuda.get_device_name()}: a decode step's KV reads, one launch in a CUDA graph (us, GB/s)",
          ["sequences x keys", "cache MB", "paged us", "GB/s", "head-major us", "GB/s", "attention us", "GB/s",
           "copy us", "GB/s (r+w)", "attention / paged", "paged / head-major"], rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
