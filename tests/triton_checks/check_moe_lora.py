"""`fused_moe` with LoRA on the routed experts (`kernels/moe_lora.py`: the grouped shrink and the
expand in place on the sorted rows) by the Triton kernels: close to the CPU reference and the
plain-torch oracle, forward and backward, in the plain and the GPT-OSS forms; bitwise what the
contract promises of the kernels themselves (a token's output the same alone as in a batch,
each pair's rows the same under every tile config, the shrink's partials as `kernels.lora`'s
for the same rows). Run as `check_triton_kernels.py` is (the interpreter in CI, or a GPU)."""

import os

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if not (INTERPRET and os.environ.get("VEXACT_BACKEND") == "triton") and not torch.cuda.is_available():
    pytest.skip("needs a GPU, or TRITON_INTERPRET=1 VEXACT_BACKEND=triton", allow_module_level=True)
DEVICE = "cpu" if INTERPRET else "cuda"

from vexact_models.kernels import SwigluClamp, fused_moe, use_backend  # noqa: E402
from vexact_models.kernels.lora import CHUNK_K, lora_shrink_triton  # noqa: E402
from vexact_models.kernels.lora_reference import lora_expand_reference  # noqa: E402
from vexact_models.kernels.moe import gate_up_act, moe_align  # noqa: E402
from vexact_models.kernels.moe_activation import ExpertForm  # noqa: E402
from vexact_models.kernels.moe_backward import moe_math  # noqa: E402
from vexact_models.kernels.moe_config import DECODE, FEW_ROWS, LARGE, SMALL  # noqa: E402
from vexact_models.kernels import expert_lora  # noqa: E402
from vexact_models.kernels.expert_lora import (REGROUP_PAIRS_PER_EXPERT, b_by_expert_triton,  # noqa: E402
                                               expert_b_operand)
from vexact_models.kernels.moe_lora import (GATE_FIRST_FROM_INTERLEAVED, IDENTITY, ROWS, ExpertLora,  # noqa: E402
                                            moe_lora_add_triton, moe_lora_shrink_triton)


def close(a, b, tol):
    a, b = a.double(), b.double()
    err = float((a - b).norm() / b.norm().clamp_min(1e-30))
    assert err < tol, err


def experts_and_adapters(experts, hidden, inter, rank, dtype, adapter_dtype=torch.float32, gpt_oss=False, seed=0):
    """Expert tensors as `fused_moe` takes them (GPT-OSS: views of HF's transposed parameters,
    with biases) and one adapter on each, in PEFT's layout."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(DEVICE)

    if gpt_oss:
        gate_up = rand(experts, hidden, 2 * inter, scale=3.0 / hidden ** 0.5).to(dtype).transpose(1, 2)
        down = rand(experts, inter, hidden, scale=inter ** -0.5).to(dtype).transpose(1, 2)
        biases = dict(gate_up_bias=rand(experts, 2 * inter).to(dtype), down_bias=rand(experts, hidden).to(dtype),
                      clamp=SwigluClamp(), interleaved=True)
    else:
        gate_up = rand(experts, 2 * inter, hidden, scale=hidden ** -0.5).to(dtype)
        down = rand(experts, hidden, inter, scale=inter ** -0.5).to(dtype)
        biases = {}
    gate_up_lora = ExpertLora(rand(experts * rank, hidden, scale=hidden ** -0.5).to(adapter_dtype),
                              rand(2 * inter, rank * experts, scale=0.5).to(adapter_dtype), 2.0)
    down_lora = ExpertLora(rand(experts * rank, inter, scale=inter ** -0.5).to(adapter_dtype),
                           rand(hidden, rank * experts, scale=0.5).to(adapter_dtype), 0.5)
    return gate_up, down, biases, gate_up_lora, down_lora


def routing(tokens, experts, top_k, seed=1):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, experts, generator=g)
    logits[:tokens // 2, 1] += 10  # one expert takes half the rows, some may get none
    w, ids = torch.softmax(logits, -1).topk(top_k, -1)
    return w.to(DEVICE), ids.to(DEVICE)


def oracle(x, gate_up, down, w, ids, biases, gate_up_lora, down_lora):
    d = {k: v.double() for k, v in biases.items() if k.endswith("bias")}
    form = ExpertForm(d.get("gate_up_bias"), d.get("down_bias"), biases.get("clamp"), biases.get("interleaved", False),
                      ExpertLora(gate_up_lora.a.double(), gate_up_lora.b.double(), gate_up_lora.scaling),
                      ExpertLora(down_lora.a.double(), down_lora.b.double(), down_lora.scaling))
    return moe_math(x.double(), gate_up.double(), down.double(), w.double(), ids, form)


@pytest.mark.parametrize("gpt_oss", [False, True])
@pytest.mark.parametrize("dtype, adapter_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                                  (torch.bfloat16, torch.bfloat16)])
@pytest.mark.parametrize("tokens", [12, 48])  # 16- and 64-row tiles at 8 experts, top-4
def test_adapted_experts_match_the_reference_and_the_oracle(gpt_oss, dtype, adapter_dtype, tokens):
    experts, hidden, inter, rank = 8, 64, 48, 4
    x = torch.randn(tokens, hidden, device=DEVICE).to(dtype)
    gate_up, down, biases, gu_lora, dn_lora = experts_and_adapters(experts, hidden, inter, rank, dtype, adapter_dtype,
                                                                   gpt_oss)
    w, ids = routing(tokens, experts, 4)
    got = fused_moe(x, gate_up, down, w, ids, gate_up_lora=gu_lora, down_lora=dn_lora, **biases)
    with use_backend("reference"):
        cpu = {k: (v.cpu() if torch.is_tensor(v) else v) for k, v in biases.items()}
        want = fused_moe(x.cpu(), gate_up.cpu(), down.cpu(), w.cpu(), ids.cpu(), **cpu,
                         gate_up_lora=ExpertLora(gu_lora.a.cpu(), gu_lora.b.cpu(), gu_lora.scaling),
                         down_lora=ExpertLora(dn_lora.a.cpu(), dn_lora.b.cpu(), dn_lora.scaling))
    # bf16: roundings moved by the reference's other summation order (check_moe_expert_forms.py)
    close(got, want.to(DEVICE), 4e-2 if dtype == torch.bfloat16 else 1e-5)
    close(got, oracle(x, gate_up, down, w, ids, biases, gu_lora, dn_lora), 5e-2 if dtype == torch.bfloat16 else 1e-5)
    plain = fused_moe(x, gate_up, down, w, ids, **biases)  # the adapters changed the output
    assert (plain.double() - got.double()).abs().max() > 1e-2


def adapted_backward(gpt_oss: bool, dtype: torch.dtype, experts: int, routed: int, tol: float) -> tuple:
    """Every gradient of adapted experts (x, the expert tensors, the routing weights, both adapters'
    A and B) against float64 autograd through the oracle, the tokens routed among the first
    `routed` experts; returns them."""
    hidden, inter, rank, tokens = 64, 32, 3, 40
    gate_up, down, biases, gu_lora, dn_lora = experts_and_adapters(experts, hidden, inter, rank, dtype, gpt_oss=gpt_oss)
    w, ids = routing(tokens, routed, 2)
    x = torch.randn(tokens, hidden, device=DEVICE).to(dtype)
    leaves = [t.detach().clone().requires_grad_() for t in (x, gate_up, down, w, gu_lora.a, gu_lora.b, dn_lora.a,
                                                              dn_lora.b)]
    out = fused_moe(*leaves[:4], ids, gate_up_lora=ExpertLora(leaves[4], leaves[5], gu_lora.scaling),
                    down_lora=ExpertLora(leaves[6], leaves[7], dn_lora.scaling), **biases)
    g = torch.randn(tokens, hidden, device=DEVICE).to(dtype)
    got = torch.autograd.grad(out, leaves, g)
    dl = [t.detach().double().requires_grad_() for t in leaves]
    want_out = oracle(dl[0], dl[1], dl[2], dl[3], ids, biases, ExpertLora(dl[4], dl[5], gu_lora.scaling),
                      ExpertLora(dl[6], dl[7], dn_lora.scaling))
    want = torch.autograd.grad(want_out, dl, g.double())
    for name, a, b in zip(("x", "gate_up", "down", "weights", "gate_up A", "gate_up B", "down A", "down B"), got, want):
        assert a.shape == b.shape, name
        close(a, b, tol)
    return got


@pytest.mark.parametrize("gpt_oss", [False, True])
def test_adapted_experts_backward_matches_autograd(gpt_oss):
    adapted_backward(gpt_oss, torch.float32, 4, 4, 1e-5)


@pytest.mark.parametrize("gpt_oss", [False, True])
def test_adapted_bf16_experts_backward_with_torchs_grouped_gemms(gpt_oss):
    """bf16 experts whose four expert GEMMs run torch's grouped GEMM (``VEXACT_MOE_BACKWARD=grouped_mm``,
    its CPU fallback here; GPT-OSS's transposed views and biases too), the adapters' parts ours, one
    expert chosen by no token (its gradients zero)."""
    from vexact_models.kernels.moe_backward import use_moe_backward

    with use_moe_backward("grouped_mm"):
        got = adapted_backward(gpt_oss, torch.bfloat16, 5, 4, 3e-2)
    assert not got[1][-1].any() and not got[2][-1].any()


def test_a_token_alone_equals_the_token_in_a_batch():
    """Rule 4 with adapters: a token's output is bitwise the same alone and among 40 others
    (other tile configs, other expert loads), fp32 adapters under bf16 activations."""
    experts, hidden, inter, rank, tokens = 8, 64, 48, 4, 41
    x = torch.randn(tokens, hidden, device=DEVICE).bfloat16()
    gate_up, down, biases, gu_lora, dn_lora = experts_and_adapters(experts, hidden, inter, rank, torch.bfloat16)
    w, ids = routing(tokens, experts, 4)
    batch = fused_moe(x, gate_up, down, w, ids, gate_up_lora=gu_lora, down_lora=dn_lora)
    for i in (0, 17, 40):
        alone = fused_moe(x[i:i + 1], gate_up, down, w[i:i + 1], ids[i:i + 1], gate_up_lora=gu_lora,
                          down_lora=dn_lora)
        assert torch.equal(alone, batch[i:i + 1])


@pytest.mark.parametrize("gpt_oss", [False, True])
def test_adapted_rows_are_the_same_for_every_tile_config(gpt_oss):
    """Each pair's adapted gate/up products are bitwise the same under the few-rows, decode,
    small and large configs (their row blocks of 16 to 128), with K past one shrink chunk."""
    experts, hidden, inter, rank, tokens, top_k = 4, CHUNK_K + 64, 32, 4, 37, 2
    x = torch.randn(tokens, hidden, device=DEVICE).bfloat16()
    gate_up, _, biases, gu_lora, _ = experts_and_adapters(experts, hidden, inter, rank, torch.bfloat16,
                                                          gpt_oss=gpt_oss)
    ids = torch.randint(0, experts, (tokens, top_k), device=DEVICE)
    form = ExpertForm(biases.get("gate_up_bias"), None, biases.get("clamp"), gpt_oss)
    rows = []
    for cfg in (FEW_ROWS, DECODE, SMALL, LARGE):
        layout = moe_align(ids, experts, cfg.block_m)
        layout.config = cfg
        preact = gate_up_act(x, gate_up, layout, top_k, cfg, True, form, store_act=False)[1]
        u = moe_lora_add_triton(preact, x, gu_lora, layout, experts, top_k, True, int(gpt_oss), keep_u=True)
        rows.append((preact[layout.pair_pos], u[layout.pair_pos]))
    for preact, u in rows[1:]:
        assert torch.equal(preact, rows[0][0]) and torch.equal(u, rows[0][1])


def test_the_grouped_shrink_is_the_dense_shrink_of_each_experts_rows():
    """u of each pair equals `kernels.lora`'s shrink of its token's row by its expert's A (the
    same chunks, tiles and accumulation), bitwise."""
    experts, hidden, inter, rank, tokens, top_k = 4, 2 * CHUNK_K + 70, 16, 4, 20, 2
    x = torch.randn(tokens, hidden, device=DEVICE).bfloat16()
    gate_up, _, _, gu_lora, _ = experts_and_adapters(experts, hidden, inter, rank, torch.bfloat16)
    ids = torch.randint(0, experts, (tokens, top_k), device=DEVICE)
    layout = moe_align(ids, experts, SMALL.block_m)
    layout.config = SMALL
    preact = gate_up_act(x, gate_up, layout, top_k, SMALL, True, store_act=False)[1]
    u = moe_lora_add_triton(preact, x, gu_lora, layout, experts, top_k, True, keep_u=True)
    pair_u = u[layout.pair_pos].view(tokens, top_k, rank)
    for e in range(experts):
        t, r = (ids == e).nonzero(as_tuple=True)
        if len(t):
            assert torch.equal(pair_u[t, r], lora_shrink_triton(x[t], gu_lora.expert_a(e, experts)))


@pytest.mark.parametrize("regroup", [False, True])
@pytest.mark.parametrize("columns", [IDENTITY, GATE_FIRST_FROM_INTERLEAVED])
@pytest.mark.parametrize("adapter_dtype", [torch.float32, torch.bfloat16])
def test_expand_is_the_reference_per_expert_and_the_rollout_skips_padding_tiles(monkeypatch, regroup, columns,
                                                                              adapter_dtype):
    """The expand over the sorted rows, B read in PEFT's layout or copied by expert
    (`expert_lora.expert_b_operand`), is bitwise the CPU reference's expand of the kept u, expert by
    expert, B's rows in the base's column order. The
    rollout's launch (no u kept) gives every pair's row the same bits and leaves the tiles of
    padding rows alone as they were (their -0.0 stays), where the training forward's launch adds
    its zero update (their x rows are masked: u is zero) and turns -0.0 into +0.0."""
    monkeypatch.setattr(expert_lora, "REGROUP_PAIRS_PER_EXPERT", 0 if regroup else 10 ** 9)
    experts, hidden, inter, rank, tokens, top_k = 8, CHUNK_K + 64, 24, 4, 21, 2
    n = 2 * inter
    x = torch.randn(tokens, hidden, device=DEVICE).bfloat16()
    _, _, _, lora, _ = experts_and_adapters(experts, hidden, inter, rank, torch.bfloat16, adapter_dtype)
    ids = routing(tokens, experts, top_k)[1]
    layout = moe_align(ids, experts, SMALL.block_m)  # 64-row segments: 16-row tiles of padding alone
    layout.config = SMALL
    base = torch.randn(layout.sorted_pairs.shape[0], n, device=DEVICE).bfloat16()
    base[layout.sorted_pairs >= layout.num_pairs] = -0.0  # a padding row's update (+0.0) would turn it +0.0
    trained, rollout = base.clone(), base.clone()
    u = moe_lora_add_triton(trained, x, lora, layout, experts, top_k, True, columns, keep_u=True)
    assert moe_lora_add_triton(rollout, x, lora, layout, experts, top_k, True, columns) is None
    pos = layout.pair_pos
    assert torch.equal(rollout[pos], trained[pos])
    tiles = lambda t: t.view(-1, ROWS, n)  # noqa: E731
    in_segment = layout.block_expert.repeat_interleave(SMALL.block_m // ROWS) >= 0
    padding = in_segment & ~(layout.sorted_pairs < layout.num_pairs).view(-1, ROWS).any(1)
    assert padding.any()
    bits = lambda t: tiles(t)[padding].view(torch.int16)  # noqa: E731
    assert torch.equal(bits(rollout), bits(base)) and not torch.equal(bits(trained), bits(base))
    assert torch.equal(u.view(-1, ROWS, rank)[padding], torch.zeros_like(u.view(-1, ROWS, rank)[padding]))
    half = torch.arange(n) % inter
    b_rows = torch.arange(n) if columns == IDENTITY else torch.where(torch.arange(n) < inter, 2 * half, 2 * half + 1)
    for e in range(experts):
        rows = pos[(ids == e).flatten()].cpu()
        want = torch.empty(len(rows), n, dtype=torch.float32)
        lora_expand_reference(base[rows].cpu(), u[rows].cpu(), lora.expert_b(e, experts).cpu()[b_rows], None, (n,),
                              (lora.scaling,), want)
        assert torch.equal(trained[rows].cpu(), want.bfloat16()), e


@pytest.mark.parametrize("experts, rank, n", [(128, 16, 40), (6, 4, 5), (40, 3, 9), (8, 64, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_b_by_expert_copy_is_torchs_copy_of_the_permuted_view(experts, rank, n, dtype):
    """`b_by_expert_triton` gives `ExpertLora.b_by_expert`'s ``[E, N, r]`` bitwise, -0.0 and NaN
    included, at ranks and expert counts that are and are not powers of two (blocks of 32 experts
    and 128 values an expert, masked at the edges), new or into `out` in place (the kept copies'
    refresh); a wrong layout or `out` is refused by name."""
    b = torch.randn(n, rank * experts, device=DEVICE).to(dtype)
    b[0, :3] = torch.tensor([-0.0, float("nan"), float("inf")])
    lora = ExpertLora(torch.zeros(experts * rank, 8, device=DEVICE), b, 1.0)
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    got = b_by_expert_triton(b, experts)
    assert got.shape == (experts, n, rank) and got.is_contiguous()
    assert torch.equal(got.view(bits), lora.b_by_expert(experts).view(bits))
    b.mul_(-2.0)
    assert b_by_expert_triton(b, experts, out=got) is got and torch.equal(got.view(bits), lora.b_by_expert(experts).view(bits))
    with pytest.raises(ValueError, match=r"b_by_expert_triton: b \(\d+, \d+\) with strides .* experts=7"):
        b_by_expert_triton(torch.zeros(n, 6 * 8, device=DEVICE), 7)
    with pytest.raises(ValueError, match=rf"b_by_expert_triton: out \({experts}, {rank}, {n}\) .* is not a contiguous "
                                         rf"\[E={experts}, N={n}, r={rank}\]"):
        b_by_expert_triton(b, experts, out=torch.empty(experts, rank, n, device=DEVICE, dtype=dtype))


def test_expand_reads_b_in_place_for_few_pairs_and_copied_by_expert_for_many():
    """`expert_b_operand`: below `REGROUP_PAIRS_PER_EXPERT` pairs an expert on average, PEFT's B itself
    with strides that read it by (expert, row, rank); from there on, a copy by expert
    (`b_by_expert_triton`), made at each call (B changed in place is read again). Both read the
    same values."""
    experts, rank, n = 6, 4, 5
    lora = ExpertLora(torch.zeros(experts * rank, 8, device=DEVICE), torch.randn(n, rank * experts, device=DEVICE), 1.0)
    want = lora.b_by_expert(experts)
    few = REGROUP_PAIRS_PER_EXPERT * experts - 1
    b, strides = expert_b_operand(lora, experts, few)
    assert b is lora.b and torch.equal(b.as_strided(want.shape, strides), want)
    b, strides = expert_b_operand(lora, experts, few + 1)
    assert b.data_ptr() != lora.b.data_ptr() and torch.equal(b, want) and strides == want.stride()
    lora.b.add_(1.0)
    assert torch.equal(expert_b_operand(lora, experts, few + 1)[0], want + 1.0)


@pytest.mark.parametrize("hidden", [CHUNK_K - 64, 3 * CHUNK_K + 70])  # one chunk; four, the last ragged
def test_the_summing_shrink_is_the_partials_added_in_chunk_order(hidden):
    """The rollout's shrink (`sum_chunks`) stores u rank-major ``[r, P]``, bitwise the training
    shrink's partials added in chunk order (``((p0 + p1) + p2) + p3``), on every pair's row."""
    experts, inter, rank, tokens, top_k = 4, 16, 4, 20, 2
    x = torch.randn(tokens, hidden, device=DEVICE).bfloat16()
    _, _, _, lora, _ = experts_and_adapters(experts, hidden, inter, rank, torch.bfloat16)
    ids = torch.randint(0, experts, (tokens, top_k), device=DEVICE)
    layout = moe_align(ids, experts, SMALL.block_m)
    layout.config = SMALL
    partials = moe_lora_shrink_triton(x, lora, layout, experts, top_k, True, False)
    u_t = moe_lora_shrink_triton(x, lora, layout, experts, top_k, True, True, sum_chunks=True)
    assert partials.shape[0] == -(-hidden // CHUNK_K) and u_t.shape == (rank, partials.shape[1])
    want = partials[0].clone()
    for p in partials[1:]:
        want += p
    pos = layout.pair_pos
    assert torch.equal(u_t.t()[pos], want[pos])
