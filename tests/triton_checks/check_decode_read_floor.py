"""benchmarks/investigations/decode_read_floor.py's read kernel, under TRITON_INTERPRET=1 on CPU and on
a GPU: through the block table it reads every cached key and value of each (sequence, KV head)
once, in the engine's cache layout and in the head-major page layout the script compares it with."""

import os
import sys
from pathlib import Path

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("needs a GPU, or TRITON_INTERPRET=1", allow_module_level=True)
DEVICE = "cpu" if INTERPRET else "cuda"

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "investigations"))

import decode_read_floor  # noqa: E402
from bench_utils import decode_layout  # noqa: E402


def test_read_kernel_sums_each_heads_keys_and_values_in_both_layouts():
    kv_heads, head_dim, page = 2, 16, 64
    layout = decode_layout(3, [5, 64, 130], page, device=DEVICE)
    slots = (int(layout.block_table.max()) + 1) * page
    k = torch.randn(slots, kv_heads, head_dim).bfloat16().to(DEVICE)
    v = torch.randn_like(k)
    want = torch.zeros(3, kv_heads, device=DEVICE)
    table = layout.block_table.tolist()  # one copy to the host, not one sync a position
    for seq, n in enumerate(layout.seq_lens.tolist()):
        rows = [table[seq][pos // page] * page + pos % page for pos in range(n)]
        want[seq] = (k[rows].float() + v[rows].float()).sum(dim=(0, 2))
    kernel = decode_read_floor._kernels()
    got = decode_read_floor.read_all(kernel, k, v, layout, kv_heads, head_dim, head_major=False).view(3, kv_heads)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3)
    # head-major pages: [page, kv_head, slot, dim]
    k_hm = k.view(-1, page, kv_heads, head_dim).transpose(1, 2).contiguous()
    v_hm = v.view(-1, page, kv_heads, head_dim).transpose(1, 2).contiguous()
    got_hm = decode_read_floor.read_all(kernel, k_hm, v_hm, layout, kv_heads, head_dim, head_major=True)
    torch.testing.assert_close(got_hm.view(3, kv_heads), want, rtol=1e-4, atol=1e-3)
