"""benchmarks/kernel_resources.py and sm90_compile.py: the attention kernels' launch candidates
compiled for Hopper (sm_90) on the CPU, with ptxas's registers, spills and shared memory; the
norm's tile layout compiled the same way."""

import subprocess
import sys
from pathlib import Path

import torch

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


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


def test_largest_loop_counts_a_backward_branchs_body():
    """`largest_loop` reads ``nvdisasm -c`` text: the instructions from a backward branch's target
    to the branch, the longest such loop; forward branches are no loop."""
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


def test_decode_over_power_of_two_pages_issues_fewer_instructions_a_key_block(monkeypatch):
    """The GQA decode launch (Qwen3-0.6B's heads, 128 x 544, the engine's pointer-load config)
    compiled for sm_90: over pages of 64 a key's page and offset are a shift and a mask
    (`attention.page_shift`), over pages of 48 a division each; the shift's key-block loop is
    at least a fifth shorter with no more registers (under Triton 3.6, with 32-bit offsets: 511
    SASS instructions against 719; 801 before either change)."""
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
    assert measured[64].loop_instructions <= 0.8 * measured[48].loop_instructions, measured
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
        layouts = re.findall(r"sizePerThread = \[1, (\d+)\], threadsPerWarp = \[\d+, (\d+)\], "
                             r"warpsPerCTA = \[(\d+), (\d+)\]", kernels[-1].asm["ttgir"])
        assert layouts, kernels[-1].asm["ttgir"][:2000]
        (size, lanes, row_warps, col_warps), = set(layouts)
        return (int(size), int(lanes), int(col_warps)), int(row_warps)

    for n in (128, 512, 1024, 1536, 2048, 4096, 7168):
        block_n = next_power_of_2(n)
        old_rows = max(1, min(64, 8192 // block_n))
        old = (old_rows, 4 if block_n * old_rows <= 2048 else 8)
        (old_axis, _), (new_axis, _) = (row_axis(n, t, torch.bfloat16) for t in (old, None))
        assert old_axis == new_axis, (n, old_axis, new_axis)
        assert norm_tile(n)[1] * norm_tile(n)[0] <= max(1024, block_n)
    assert row_axis(1024, (8, 8), torch.float32)[0] != row_axis(1024, None, torch.float32)[0]


def test_hybrid_ops_compile_for_hopper_without_spills(monkeypatch):
    """The kernels of the gated-DeltaNet hybrids (Qwen3.5, Qwen3-Next) compiled for sm_90 on the CPU
    at their model shapes, every form a model launches: the causal conv1d (training, with a bias,
    the rollout form for prefill pieces and decode, the backward's gradient mode), its state update,
    the gated and zero-centred norms and the gated backward, the sigmoid gates, partial rotary, and
    the attention at head dim 256 in the tiles `pick_config` gives it (training, prefill, decode):
    none spills."""
    import importlib

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    from sm90_compile import compile_only, resources

    from vexact_models.kernels.attention import PagedLayout, attention_triton, packed_layout
    from vexact_models.kernels.causal_conv1d_backward import conv_grads_triton
    from vexact_models.kernels.gated_rms_norm import gated_rms_norm_triton
    from vexact_models.kernels.rms_norm import rms_norm_backward_triton, rms_norm_triton
    from vexact_models.kernels.rotary import apply_rotary, rope_table
    from vexact_models.kernels.sigmoid_gate import sigmoid_gate_triton

    conv = importlib.import_module("vexact_models.kernels.causal_conv1d")
    bf = torch.bfloat16
    with compile_only() as kernels:
        x, w = torch.randn(64, 8192).to(bf), torch.randn(8192, 4).to(bf)
        cu, idx = torch.tensor([0, 30, 64], dtype=torch.int32), torch.tensor([1, 2], dtype=torch.int32)
        state = torch.zeros(4, 3, 8192).to(bf)
        conv._launch(x, w, None, cu, 34, True)
        conv._launch(x, w, w[:, 0].contiguous(), cu, 34, True)
        conv._launch(x, w, None, cu, 34, True, (state, idx, idx))
        conv._launch(x, w, None, cu, 1, True, (state, idx, idx))
        conv._launch(x, w, None, cu, 34, True, dy=x)
        conv_grads_triton(x, w, cu, 34, x.float())
        conv._conv_state_update_kernel[(2, 8)](x, state, cu, idx, idx, 8192, x.stride(0), state.stride(0),
                                               state.stride(1), KEEP=3, BLOCK_K=4, BLOCK_C=1024, num_warps=4)
        z = torch.randn(64 * 32, 128).to(bf)
        gated_rms_norm_triton(z, z, torch.ones(128).to(bf), 1e-6)
        rms_norm_backward_triton(z, torch.ones(128).to(bf), 1e-6, z, gate=z)
        rms_norm_triton(torch.randn(64, 2048).to(bf), torch.ones(2048).to(bf), 1e-6, zero_centred=True)
        q = torch.randn(64, 16, 256).to(bf)
        sigmoid_gate_triton(q, torch.randn(64, 16, 512).to(bf)[..., 256:])
        sigmoid_gate_triton(torch.randn(64, 2048).to(bf), torch.randn(64, 1).to(bf))
        cos, sin = rope_table(1.0 / (1e4 ** (torch.arange(0, 64, 2) / 64)), 100)
        with monkeypatch.context() as m:
            m.setattr(importlib.import_module("vexact_models.kernels.rotary"), "select", lambda *a, **k: "triton")
            apply_rotary(q, torch.zeros(64, dtype=torch.long), cos, sin)
        k = torch.randn(300, 2, 256).to(bf)
        attention_triton(torch.randn(300, 16, 256).to(bf), k, k, packed_layout(torch.tensor([0, 100, 300], dtype=torch.int32),
                                                                              200), 0.06)
        layout = PagedLayout(torch.tensor([0, 1, 2], dtype=torch.int32), torch.tensor([100, 200], dtype=torch.int32),
                             torch.arange(38, dtype=torch.int32).view(2, 19), 16, 1)
        attention_triton(torch.randn(2, 16, 256).to(bf), k, k, layout, 0.06)
    assert len(kernels) == 15, [kernel.name for kernel in kernels]
    for kernel in kernels:
        found = resources(kernel)
        assert found.spill_bytes == 0, found


def test_gated_delta_gates_compile_for_hopper_as_the_reference_computes(monkeypatch):
    """The gates kernel's float64 exp / log (`exact_math_triton`) compiled for sm_90: no product is
    contracted into an FMA (the reference rounds each), the polynomial coefficients are float64
    constants, not fp32 ones widened (1/3 and log2(e) in full), the division is IEEE's; no spill."""
    import struct

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    from sm90_compile import compile_only, resources

    from vexact_models.kernels.gated_delta_gates import gated_delta_gates_triton

    bf = torch.bfloat16
    with compile_only() as kernels:
        projections = torch.zeros(64, 96).to(bf)
        gated_delta_gates_triton(projections[:, :32], projections[:, 64:], torch.zeros(32), torch.zeros(32).to(bf))
    (kernel,) = kernels
    ptx = kernel.asm["ptx"]
    assert "fma" not in ptx and "div.rn.f64" in ptx and "div.full" not in ptx
    for value in (1 / 3, 1.4426950408889634):
        assert "0d%016X" % struct.unpack("<Q", struct.pack("<d", value))[0] in ptx
    assert resources(kernel).spill_bytes == 0


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


def test_lora_kernels_compile_for_hopper_without_spills(monkeypatch):
    """`kernels.lora_add`'s launches compiled for sm_90 on the CPU at Qwen3-8B's q/k/v (K 4096, 8
    partials) and down (K 12288, 24 partials) with fp32 adapters under bf16 activations (PEFT's
    default), and at the gated-DeltaNet's four-member in_proj with bf16 ones: the shrink (its split
    A: two bf16 MMAs a K step), the expand adding the partials itself (the rollout's; the training
    forward's, which also keeps u) and the reduce of `lora_shrink_triton`. None spills but the
    three-member expand without u, where ptxas (triton 3.6's) keeps 96 registers and spills 32
    bytes a thread (the old expand, which read u, took 67 and none; the GPU's figures tell whether it
    matters)."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    from sm90_compile import compile_only, resources

    from vexact_models.kernels.lora import lora_partials_triton, lora_shrink_triton
    from vexact_models.kernels.lora_expand import lora_expand_triton

    bf, rank = torch.bfloat16, 16
    with compile_only() as kernels:
        for k, sizes, adapter_dtype in ((4096, (4096, 1024, 1024), torch.float32), (12288, (4096,), torch.float32),
                                        (2048, (8192, 4096, 32, 32), bf)):
            x, n = torch.zeros(256, k, dtype=bf), sum(sizes)
            a, b = torch.zeros(len(sizes) * rank, k, dtype=adapter_dtype), torch.zeros(n, rank, dtype=adapter_dtype)
            base = torch.zeros(256, n, dtype=bf)
            partials = lora_partials_triton(x, a)
            scalings = (2.0,) * len(sizes)
            lora_expand_triton(base, partials, b, None, sizes, scalings, base)
            lora_expand_triton(base, partials, b, None, sizes, scalings, base, torch.zeros(256, len(sizes) * rank))
        lora_shrink_triton(x, a)
    names = [kernel.name for kernel in kernels]
    assert names.count("_lora_shrink_kernel") == 4 and names.count("_lora_expand_kernel") == 6, names
    assert names.count("_lora_reduce_kernel") == 1, names
    for kernel in kernels:
        found = resources(kernel)
        assert found.spill_bytes <= (64 if kernel.name == "_lora_expand_kernel" else 0), found
        if kernel.name == "_lora_shrink_kernel":
            assert found.mma != "none", found


def test_expert_lora_kernels_compile_for_hopper_without_spills(monkeypatch):
    """`kernels/moe_lora.py`'s launches (the grouped shrink, gathered from tokens for gate/up and
    from the sorted activation rows for down, with fp32 adapters under bf16 activations and with
    bf16 ones; the in-place expand, gate-first over interleaved B rows too, with and without
    keeping u) and the activation's own launch compiled for sm_90 on the CPU at Qwen3-30B-A3B's
    expert shapes (hidden 2048, expert intermediate 768, 128 experts, r 16): tensor-core shrinks,
    no spills."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    from sm90_compile import compile_only, resources

    from vexact_models.kernels import ExpertLora
    from vexact_models.kernels.moe_activation import expert_activation_rows
    from vexact_models.kernels.moe_align import MoeLayout
    from vexact_models.kernels.moe_config import DECODE
    from vexact_models.kernels.moe_lora import GATE_FIRST_FROM_INTERLEAVED, IDENTITY, moe_lora_add_triton

    bf, rank, experts, hidden, inter, top_k, tokens = torch.bfloat16, 16, 128, 2048, 768, 8, 256
    rows = 4096
    layout = MoeLayout(torch.zeros(rows, dtype=torch.int32), torch.zeros(tokens * top_k, dtype=torch.int32),
                       torch.zeros(rows // DECODE.block_m, dtype=torch.int32), torch.zeros(experts + 1, dtype=torch.int32),
                       tokens * top_k, DECODE)
    x, act = torch.zeros(tokens, hidden, dtype=bf), torch.zeros(rows, inter, dtype=bf)
    with compile_only() as kernels:
        for adapter_dtype in (torch.float32, bf):
            gate_up = ExpertLora(torch.zeros(experts * rank, hidden, dtype=adapter_dtype),
                                 torch.zeros(2 * inter, rank * experts, dtype=adapter_dtype), 2.0)
            down = ExpertLora(torch.zeros(experts * rank, inter, dtype=adapter_dtype),
                              torch.zeros(hidden, rank * experts, dtype=adapter_dtype), 2.0)
            for columns, keep_u in ((IDENTITY, False), (GATE_FIRST_FROM_INTERLEAVED, True)):
                moe_lora_add_triton(torch.zeros(rows, 2 * inter, dtype=bf), x, gate_up, layout, experts, top_k, True,
                                    columns, keep_u)
            moe_lora_add_triton(torch.zeros(rows, hidden, dtype=bf), act, down, layout, experts, top_k, False)
        expert_activation_rows(torch.zeros(rows, 2 * inter, dtype=bf), None, layout.block_expert, DECODE.block_m)
    names = [kernel.name for kernel in kernels]
    assert names.count("_moe_lora_shrink_kernel") == 6 and names.count("_moe_lora_expand_kernel") == 6, names
    assert names.count("_expert_activation_rows_kernel") == 1, names
    for kernel in kernels:
        found = resources(kernel)
        assert found.spill_bytes == 0, found
        if kernel.name == "_moe_lora_shrink_kernel":
            assert found.mma != "none", found


def test_interleaved_gate_up_reads_its_weight_tiles_by_async_copies(monkeypatch):
    """GPT-OSS's gate/up kernel (rows interleaved, HF's ``[E, H, 2I]`` read as ``[E, 2I, H]``) at its
    decode shape (hidden and expert intermediate 2,880, 32 experts, top 4, `DECODE` tiles) compiled
    for sm_90 on the CPU: the weights arrive by 16-byte async copies into a pipeline, as the
    gate-first form's do, not by element loads (two stride-2 tiles took 72 16-bit loads a K step,
    232 registers, no pipelining; its decode layer ran at ~9% of the copy bandwidth on the H200),
    and no spills."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    from sm90_compile import compile_only, resources

    from vexact_models.kernels.moe import gate_up_act
    from vexact_models.kernels.moe_activation import ExpertForm, SwigluClamp
    from vexact_models.kernels.moe_align import MoeLayout
    from vexact_models.kernels.moe_config import DECODE

    bf, experts, hidden, inter, top_k, tokens, rows = torch.bfloat16, 32, 2880, 2880, 4, 64, 4096
    layout = MoeLayout(torch.zeros(rows, dtype=torch.int32), torch.zeros(tokens * top_k, dtype=torch.int32),
                       torch.zeros(rows // DECODE.block_m, dtype=torch.int32), torch.zeros(experts + 1, dtype=torch.int32),
                       tokens * top_k, DECODE)
    form = ExpertForm(gate_up_bias=torch.zeros(experts, 2 * inter, dtype=bf), clamp=SwigluClamp(1.702, 7.0),
                      interleaved=True)
    with compile_only() as kernels:
        gate_up_act(torch.zeros(tokens, hidden, dtype=bf), torch.zeros(experts, hidden, 2 * inter, dtype=bf).transpose(1, 2),
                    layout, top_k, DECODE, form=form)
    (kernel,) = kernels
    ptx = kernel.asm["ptx"]
    found = resources(kernel)
    assert ptx.count("cp.async.cg") >= 24 and ptx.count("ld.global.b16") <= 8, found
    assert found.spill_bytes == 0 and found.registers <= 160 and found.mma == "mma.sync", found
