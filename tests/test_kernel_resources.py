"""benchmarks/kernel_resources.py and sm90_compile.py: the attention kernels' launch candidates
compiled for Hopper (sm_90) on the CPU, with ptxas's registers, spills and shared memory, and the
source lines each tile fuses into FMAs; the norm's tile layout compiled the same way."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vexact_models.kernels.gluon_support import GLUON_VERIFIED, HAS_GLUON

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
needs_gluon = pytest.mark.skipif(not HAS_GLUON, reason=f"the Gluon kernels run under Triton {GLUON_VERIFIED} only")


def test_kernel_resources_compiles_for_hopper_on_cpu():
    """benchmarks/kernel_resources.py compiles the decode attention candidates for sm_90 without a
    GPU: the 16-row latent and GQA decode tiles become mma.sync, each with ptxas's counts; a shape
    of another kernel exits 2 naming the flag."""
    script = "kernel_resources.py"
    env = {"CUDA_VISIBLE_DEVICES": "", "PATH": "/usr/bin:/bin", "PYTHONWARNINGS": "ignore"}
    help_run = subprocess.run([sys.executable, script, "--help"], cwd=BENCHMARKS, capture_output=True, text=True,
                              timeout=120)
    assert help_run.returncode == 0 and "--shape" in help_run.stdout and "--kernel" in help_run.stdout
    for kernel, count in (("latent", 4), ("gqa", 4)):
        run = subprocess.run([sys.executable, script, "--kernel", kernel, "--shape", "tiny"], cwd=BENCHMARKS,
                             capture_output=True, text=True, timeout=300, env=env)
        assert run.returncode == 0, run.stderr[-3000:]
        rows = [line.split() for line in run.stdout.splitlines() if line.strip().startswith("m16")]
        assert len(rows) == count, run.stdout
        for row in rows:
            assert row[-6].startswith("mma.sync"), row
            assert 0 < int(row[-5]) <= 255 and int(row[-4]) >= 0 and int(row[-2]) >= 1 and int(row[-1]) > 0, row
    bad = subprocess.run([sys.executable, script, "--kernel", "gqa", "--shape", "moonlight"], cwd=BENCHMARKS,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--shape 'moonlight' is not a gqa shape" in bad.stderr


@needs_gluon
def test_kernel_resources_lists_the_gluon_latent_decode_at_moonlights_shape(monkeypatch):
    """The Gluon latent decode launch compiles for sm_90 on the CPU at Moonlight's decode shape:
    warpgroup MMAs, no spills, one and four value chunks; shapes it does not take list nothing."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import kernel_resources

    q, kv, layout = kernel_resources.decode_inputs(16, 512, 64)
    rows = kernel_resources.measure_gluon(q, kv, 512, layout)
    assert [row[0] for row in rows] == ["gluon w4 s2", "gluon w4 s2 v4"]
    for label, loads, mma, registers, spills, shared_kb, per_sm, _ in rows:
        assert mma == "wgmma" and spills == 0 and 0 < registers <= 255 and per_sm == 1, label
    deepseek = kernel_resources.decode_inputs(128, 512, 64)  # 128 heads: the Triton launch's
    assert kernel_resources.measure_gluon(deepseek[0], deepseek[1], 512, deepseek[2]) == []


@needs_gluon
def test_kernel_resources_lists_the_gluon_latent_prefill_at_moonlights_shape(monkeypatch):
    """The Gluon prefill launch compiles for sm_90 on the CPU at Moonlight's shape: the default (64
    rows, 8 warps, one stage) without spills, one program an SM; two stages ask for more shared
    memory than an SM has (no program fits), which is why the default takes one."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import kernel_resources

    rows = kernel_resources.measure_prefill(16, 512, 64, candidates=((64, 8, 1), (64, 8, 2)), triton_tile=False)
    assert [row[0] for row in rows] == ["gluon prefill r64 w8 s1", "gluon prefill r64 w8 s2"]
    (_, _, mma, registers, spills, shared_kb, per_sm, _), two_stages = rows
    assert mma == "wgmma" and spills == 0 and 0 < registers <= 255 and per_sm == 1 and int(shared_kb) <= 227
    assert two_stages[-2] == 0 and int(two_stages[-3]) > 227
    assert kernel_resources.measure_prefill(8, 512, 64, triton_tile=False) == []  # 8 heads: not in HEADS


@needs_gluon
def test_kernel_resources_lists_the_gluon_gqa_prefill_at_qwen3_8bs_shape(monkeypatch):
    """The GQA prefill launches compile for sm_90 on the CPU at Qwen3-8B's shape: the Triton 128-row
    tile (wgmma), then the Gluon kernel's long-sequence launch (4 stages, 232 consumer and 40 producer
    registers) without spills, one 12-warp program an SM; head dim 64 lists the Triton tile alone
    (the Gluon kernel takes 128)."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import kernel_resources

    rows = kernel_resources.measure_gqa_prefill(32, 8, 128, candidates=((4, 232, 40),))
    assert [row[0] for row in rows] == ["prefill m128 n64 w4 s2", "gluon prefill s4 c232 p40"]
    (_, _, mma, registers, spills, shared_kb, per_sm, _) = rows[1]
    assert mma == "wgmma" and spills == 0 and 0 < registers <= 168 and per_sm == 1 and 128 <= int(shared_kb) <= 227
    assert [row[0] for row in kernel_resources.measure_gqa_prefill(4, 2, 64)] == ["prefill m128 n64 w4 s2"]


def test_kernel_resources_programs_per_sm():
    sys.path.insert(0, str(BENCHMARKS))
    from sm90_compile import KernelResources

    # 255 registers x 256 threads fit once in 64K registers; 164 KB of shared memory once in 227
    assert KernelResources("k", 255, 0, 164 * 1024, 8, 0, 136).programs_per_sm() == 1
    assert KernelResources("k", 85, 0, 25 * 1024, 4, 28, 0).programs_per_sm() == 6  # registers: 65536 // (85 * 128)
    assert KernelResources("k", 32, 0, 100 * 1024, 4, 0, 0).programs_per_sm() == 2  # shared memory
    assert KernelResources("k", 32, 0, 0, 4, 3, 2).mma == "wgmma+mma.sync"
    assert KernelResources("k", 32, 0, 0, 4, 0, 0).mma == "none"


def test_largest_loop_counts_a_backward_branchs_body(monkeypatch):
    """`largest_loop` reads ``nvdisasm -c`` text: the instructions from a backward branch's target
    to the branch, the longest such loop; forward branches are no loop."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    from sm90_compile import largest_loop

    sass = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
    .L_x_0:
        /*0010*/                   IADD3 R2, R2, 0x1, RZ ;
        /*0020*/                   ISETP.GE.AND P0, PT, R2, 0x8, PT ;
        /*0030*/              @!P0 BRA `(.L_x_0) ;
        /*0040*/                   BRA `(.L_x_1) ;
    .L_x_2:
        /*0050*/                   NOP ;
        /*0060*/                   BRA `(.L_x_2) ;
    .L_x_1:
        /*0070*/                   EXIT ;
"""
    assert largest_loop(sass) == 3
    assert largest_loop("") == 0


def test_fused_lines_names_the_source_line_of_each_fma(monkeypatch):
    """`fused_lines` reads PTX: each ``fma.rn`` belongs to the source line of the ``.loc`` before
    it (by the ``.file`` table's base name); other instructions and a ``.loc`` without an FMA add
    nothing."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    from sm90_compile import fused_lines

    ptx = """
    .file 1 "/repo/kernels/attention.py"
    .file 2 "/site/triton/language/standard.py"
        .loc 1 74 20
        fma.rn.f32 %f3, %f1, %f2, %f0;
        mul.rn.f32 %f4, %f1, %f2;
        .loc 2 263 15
        add.f32 %f5, %f4, %f3;
        .loc 1 75 9
        fma.rn.ftz.f32 %f6, %f4, %f5, %f3;
        fma.rn.f32 %f7, %f4, %f5, %f6;
    """
    assert fused_lines(ptx) == {("attention.py", 74), ("attention.py", 75)}
    assert fused_lines("") == set()


def test_every_attention_tile_fuses_the_same_lines(monkeypatch):
    """The GQA attention kernel compiled for sm_90 under the tiles its launches take (decode's
    16-row tiles on two and four warps over paged caches; prefill's 64-row and training's 128-row
    on four and eight warps over packed tensors), at head dims 128 and 256: the compiler fuses the
    same source lines into FMAs under each (`fused_lines`), so no tile computes a product and a sum
    that another rounds apart. The bits themselves: `kernel_invariance --only attention` on the
    GPU."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import kernel_resources
    from sm90_compile import compile_only, fused_lines

    from vexact_models.kernels.attention import AttentionConfig, attention_triton, packed_layout

    bf = torch.bfloat16
    for d in (128, 256):
        seen = {}
        q, kv, layout = kernel_resources.decode_inputs(16, d, 0, seqs=16, context=544, kv_heads=8)
        packed = torch.zeros(300, 16, d, dtype=bf), torch.zeros(300, 8, d, dtype=bf)
        training = packed_layout(torch.tensor([0, 100, 300], dtype=torch.int32), 200)
        with compile_only() as compiled:
            for rows, warps in ((16, 2), (16, 4)):
                attention_triton(q, kv, kv, layout, d ** -0.5, AttentionConfig(rows, 64, warps, 3), page_descriptors=False)
                seen[f"decode {rows} x {warps}"] = fused_lines(compiled[-1].asm["ptx"])
            for rows, warps in ((64, 4), (128, 4), (128, 8)):
                attention_triton(packed[0], packed[1], packed[1], training, d ** -0.5, AttentionConfig(rows, 64, warps, 2))
                seen[f"packed {rows} x {warps}"] = fused_lines(compiled[-1].asm["ptx"])
        first = next(iter(seen.values()))
        assert first, seen  # the exponent's explicit tl.fma at least
        assert all(lines == first for lines in seen.values()), (d, seen)


def test_every_latent_attention_tile_fuses_the_same_lines(monkeypatch):
    """The latent (MLA) Triton kernel at Moonlight's shape compiled for sm_90 under decode's
    16-row tiles (TMA, one value chunk on eight warps and four chunks on four) and prefill's 64-row
    tile (pointer loads): the same source lines fused into FMAs under each, as for the GQA kernel
    above. The bits: `kernel_invariance --only latent` on the GPU."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import kernel_resources
    from sm90_compile import compile_only, fused_lines

    from vexact_models.kernels.latent_attention import LatentConfig, latent_attention_triton

    heads, lat, rope = kernel_resources.SHAPES["latent"]["moonlight"]
    seen = {}
    with compile_only() as compiled:
        q, kv, layout = kernel_resources.decode_inputs(heads, lat, rope)
        for cfg in (LatentConfig(16, 64, 8, 3), LatentConfig(16, 64, 4, 3, 4)):
            latent_attention_triton(q, kv, lat, layout, lat ** -0.5, cfg, kv_descriptors=True)
            seen[f"decode {cfg}"] = fused_lines(compiled[-1].asm["ptx"])
        q, kv, layout = kernel_resources.prefill_inputs(heads, lat, rope)
        latent_attention_triton(q, kv, lat, layout, lat ** -0.5, LatentConfig(64, 64, 8, 2), kv_descriptors=False)
        seen["prefill 64 x 8"] = fused_lines(compiled[-1].asm["ptx"])
    first = next(iter(seen.values()))
    assert first and all(lines == first for lines in seen.values()), seen


def test_decode_over_power_of_two_pages_issues_fewer_instructions_a_key_block(monkeypatch):
    """The GQA decode launch (Qwen3-0.6B's heads, 128 x 544, the engine's pointer-load config)
    compiled for sm_90: over pages of 64 a key's page and offset are a shift and a mask
    (`attention.page_shift`), over pages of 48 a division each; the shift's key-block loop is
    at least 15% shorter with no more registers (under Triton 3.6, with 32-bit offsets: 511
    SASS instructions against 719; 801 before either change; under Triton 3.9, whose division is
    shorter, 441 against 550)."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import kernel_resources
    from sm90_compile import compile_only, resources

    from vexact_models.kernels.attention import AttentionConfig, attention_triton

    measured = {}
    with compile_only() as compiled:
        for page in (64, 48):
            q, kv, layout = kernel_resources.decode_inputs(16, 128, 0, seqs=128, context=544, page=page, kv_heads=8)
            attention_triton(q, kv, kv, layout, 128 ** -0.5, AttentionConfig(16, 64, 4, 3, heads_fastest=True),
                             page_descriptors=False)
            measured[page] = resources(compiled[-1])
    assert measured[64].loop_instructions <= 0.85 * measured[48].loop_instructions, measured
    assert measured[64].registers <= measured[48].registers, measured


def test_norm_tile_keeps_each_bf16_rows_lanes_and_warps(monkeypatch):
    """`rms_norm.norm_tile` (about 1,024 elements a program since 2026-11-28) lays a
    bf16 row over the same per-thread values, lanes and warps as the 8,192-element tiles the H200's
    conformance runs were made with, at every row width the models' norms have (q/k heads,
    latent ranks, hidden sizes): the row axis of the compiled sm_90 layout is unchanged, so
    `tl.sum` adds each row in the same order (rule 3). Only the number of rows a program holds
    changes. (fp32 rows of 1,024 do change: 4 warps of 32 lanes of 4 values take two passes.)"""
    import re

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    from sm90_compile import compile_only

    from vexact_models.kernels._triton import next_power_of_2
    from vexact_models.kernels.rms_norm import norm_tile, rms_norm_triton

    def row_axis(n, tile, dtype):
        """(sizePerThread, threadsPerWarp, warpsPerCTA) along the columns of the 2-D tile layout."""
        with compile_only() as kernels:
            rms_norm_triton(torch.randn(4, n).to(dtype), torch.ones(n).to(dtype), 1e-6, tile=tile)
        ttgir = kernels[-1].asm["ttgir"]
        # the layout of the 2-D tile's load (Triton 3.9 also lays the row indices out in a layout of their own)
        tile = re.search(r"tt\.load [^\n]*: tensor<\d+x\d+x!tt\.ptr<\w+>, #(\w+)>", ttgir)
        assert tile, ttgir[:2000]
        layout = re.search(rf"#{tile.group(1)} = #ttg\.blocked<\{{sizePerThread = \[1, (\d+)\], "
                           r"threadsPerWarp = \[\d+, (\d+)\], warpsPerCTA = \[(\d+), (\d+)\]", ttgir)
        assert layout, ttgir[:2000]
        size, lanes, row_warps, col_warps = layout.groups()
        return (int(size), int(lanes), int(col_warps)), int(row_warps)

    for n in (128, 512, 1024, 1536, 2048, 4096, 7168):
        block_n = next_power_of_2(n)
        old_rows = max(1, min(64, 8192 // block_n))
        old = (old_rows, 4 if block_n * old_rows <= 2048 else 8)
        (old_axis, _), (new_axis, _) = (row_axis(n, t, torch.bfloat16) for t in (old, None))
        assert old_axis == new_axis, (n, old_axis, new_axis)
        assert norm_tile(n)[1] * norm_tile(n)[0] <= max(1024, block_n)
    assert row_axis(1024, (8, 8), torch.float32)[0] != row_axis(1024, None, torch.float32)[0]


def test_windowed_attention_with_sinks_compiles_for_hopper_as_the_plain_launch(monkeypatch):
    """Sliding windows and sinks (`kernels/attention_window.py`) at GPT-OSS's (64 / 8 heads, head
    dim 64), Mistral's (32 / 8, 128) and Gemma 3's (8 / 4, 256) shapes, compiled for sm_90 on the
    CPU in every form a model launches, each beside the same launch without them: training tiles
    (`pick_config`'s, TMA K/V below head dim 256), prompt-chunk tiles, decode by pointer loads and
    by TMA pages; the backward's two kernels. None spills where the plain launch does not; those
    that spill without a window too (the 128-row four-warp training tile at head dim 128, ~600
    bytes, chosen for its speed by `pick_config`; the backward's dQ kernel at head dim 256) spill
    at most a tenth more."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    from sm90_compile import compile_only, resources

    from vexact_models.kernels.attention import AttentionConfig, PagedLayout, attention_triton, packed_layout
    from vexact_models.kernels.attention_backward import attention_backward_triton
    from vexact_models.kernels.attention_tiles import pick_config

    bf = torch.bfloat16
    cu = torch.tensor([0, 100, 300], dtype=torch.int32)
    decode = PagedLayout(torch.tensor([0, 1, 2], dtype=torch.int32), torch.tensor([100, 200], dtype=torch.int32),
                         torch.arange(8, dtype=torch.int32).view(2, 4), 64, 1)
    with compile_only() as kernels:
        for hq, hkv, d, window in ((64, 8, 64, 128), (32, 8, 128, 4096), (8, 4, 256, 1024)):
            q, k = torch.zeros(300, hq, d, dtype=bf), torch.zeros(300, hkv, d, dtype=bf)
            cache = torch.zeros(512, hkv, d, dtype=bf)
            for options in ({}, dict(window=window, sinks=torch.zeros(hq))):
                attention_triton(q, k, k, packed_layout(cu, 200), 0.1, pick_config(d, 200 * hq // hkv, bf),
                                 kv_descriptors=d < 256, **options)
                attention_triton(q, k, k, packed_layout(cu, 200), 0.1, AttentionConfig(64, 64, 4, 2), **options)
                for tma in (False, True)[:1 + (d < 256)]:
                    attention_triton(q[:2], cache, cache, decode, 0.1, AttentionConfig(16, 64, 4, 3), page_descriptors=tma,
                                     **options)
            for backward_window in (None, window):
                attention_backward_triton(q, q, k, k, q, torch.zeros(300, hq), cu, 200, 0.1, backward_window)
    assert len(kernels) == 2 * (3 * 3 + 2) + 2 * 3 + 2 * 3, [kernel.name for kernel in kernels]
    found = [resources(kernel) for kernel in kernels]
    # per shape: the plain forms, the same forms windowed with sinks, the backward's two kernels
    # plain, then windowed
    pairs = [(found[0:4] + found[8:10], found[4:8] + found[10:12]),
             (found[12:16] + found[20:22], found[16:20] + found[22:24]),
             (found[24:27] + found[30:32], found[27:30] + found[32:34])]
    for plain, windowed in pairs:
        for a, b in zip(plain, windowed):
            assert b.spill_bytes <= a.spill_bytes * 1.1, (a, b)
