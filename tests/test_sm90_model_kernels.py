"""The model families' Triton kernels compiled for Hopper (sm_90) on the CPU
(`benchmarks/sm90_compile.py`, ptxas's registers, spills and PTX): the gated-DeltaNet hybrids' ops
and their gates, the LoRA shrink and expand, the experts' LoRA and the interleaved gate/up tile.
The attention and norm launches are tests/test_kernel_resources.py's."""

import itertools
from pathlib import Path

import torch

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


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
                                               state.stride(1), KEEP=3, BLOCK_K=4, BLOCK_C=1024, num_warps=4,
                                               enable_fp_fusion=True)  # as causal_conv1d launches it
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


def test_lora_kernels_compile_for_hopper_without_spills(monkeypatch):
    """`kernels.lora_add`'s launches compiled for sm_90 on the CPU at Qwen3-8B's q/k/v (K 4096, 8
    partials) and down (K 12288, 24 partials) with fp32 adapters under bf16 activations (PEFT's
    default), and at the gated-DeltaNet's four-member in_proj with bf16 ones: the shrink (its split
    A: two bf16 MMAs a K step), the expand adding the partials itself (the rollout's; the training
    forward's, which also keeps u) and the reduce of `lora_shrink_triton`. None spills but the
    three-member expand without u, where ptxas (triton 3.6's) keeps 96 registers and spills 32
    bytes a thread (the old expand, which read u, took 67 and none; the GPU's figures tell whether it
    matters). No expand holds an FMA: its launch turns contraction off, so each rank's product is
    rounded before it is added, as the reference does, whatever the tile."""
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
        if kernel.name == "_lora_expand_kernel":  # each rank's product rounded before its sum, as the reference
            assert "fma" not in kernel.asm["ptx"], kernel.name


def test_expert_lora_kernels_compile_for_hopper_without_spills(monkeypatch):
    """`kernels/moe_lora.py`'s launches (the grouped shrink, gathered from tokens for gate/up and
    from the sorted activation rows for down, with fp32 adapters under bf16 activations and with
    bf16 ones, both the partials' and the rollout's summing one; the in-place expand, gate-first
    over interleaved B rows too, the training forward's of the partials keeping u and the
    rollout's of u, B read in PEFT's layout and copied by expert) and the activation's own launch
    compiled for sm_90 on the CPU at Qwen3-30B-A3B's expert shapes (hidden 2048, expert
    intermediate 768, 128 experts, r 16): tensor-core shrinks, no spills, no FMA in the expands (each
    product rounded before its sum, as the reference)."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    from sm90_compile import compile_only, resources

    from vexact_models.kernels import ExpertLora
    from vexact_models.kernels.moe_activation import expert_activation_rows
    from vexact_models.kernels.moe_align import MoeLayout
    from vexact_models.kernels.moe_config import DECODE
    from vexact_models.kernels import expert_lora
    from vexact_models.kernels.moe_lora import GATE_FIRST_FROM_INTERLEAVED, IDENTITY, moe_lora_add_triton

    bf, rank, experts, hidden, inter, top_k, tokens = torch.bfloat16, 16, 128, 2048, 768, 8, 256
    rows = 4096
    layout = MoeLayout(torch.zeros(rows, dtype=torch.int32), torch.zeros(tokens * top_k, dtype=torch.int32),
                       torch.zeros(rows // DECODE.block_m, dtype=torch.int32), torch.zeros(experts + 1, dtype=torch.int32),
                       tokens * top_k, DECODE)
    x, act = torch.zeros(tokens, hidden, dtype=bf), torch.zeros(rows, inter, dtype=bf)
    with compile_only() as kernels:
        for adapter_dtype, regroup in itertools.product((torch.float32, bf), (False, True)):
            monkeypatch.setattr(expert_lora, "REGROUP_PAIRS_PER_EXPERT", 0 if regroup else 10 ** 9)
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
    # the training forward's expand (u kept) at gate/up, the rollout's expand of u at the other two
    assert names.count("_moe_lora_shrink_kernel") == 12 and names.count("_moe_lora_expand_kernel") == 4, names
    assert names.count("_moe_lora_expand_u_kernel") == 8, names
    assert names.count("_expert_activation_rows_kernel") == 1, names
    for kernel in kernels:
        found = resources(kernel)
        assert found.spill_bytes == 0, found
        if kernel.name == "_moe_lora_shrink_kernel":
            assert found.mma != "none", found
        if kernel.name.startswith("_moe_lora_expand"):  # products rounded before their sums, as the reference
            assert "fma" not in kernel.asm["ptx"], kernel.name


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
