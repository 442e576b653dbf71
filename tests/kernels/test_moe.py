import pytest
import torch

from vexact_models.kernels.moe import fused_moe, moe_align
from vexact_models.kernels.moe_backward import moe_math
from vexact_models.kernels.moe_config import DECODE, FEW_ROWS, LARGE, SMALL, k_tile, pick_config
from vexact_models.kernels.moe_grouped_gemm import tma_weight_layout, weight_rows, weights_by_tma
from vexact_models.kernels.moe_routing import softmax_topk

from ..conftest import rel_err


def _weights(experts=8, hidden=32, inter=16, dtype=torch.float32):
    gate_up = (torch.randn(experts, 2 * inter, hidden) / hidden ** 0.5).to(dtype)
    down = (torch.randn(experts, hidden, inter) / inter ** 0.5).to(dtype)
    return gate_up, down


@pytest.mark.parametrize("norm", [True, False])
def test_softmax_topk_matches_float64(norm):
    logits = torch.randn(50, 16)
    w, ids = softmax_topk(logits, 4, norm)
    probs = torch.softmax(logits.double(), -1)
    top, top_ids = probs.topk(4, dim=-1)
    if norm:
        top = top / top.sum(-1, keepdim=True)
    assert torch.equal(ids, top_ids) and torch.allclose(w.double(), top, atol=1e-6)


def test_softmax_topk_ties_take_lowest_index_and_rows_are_invariant():
    logits = torch.zeros(3, 8)
    logits[:, 5] = 1.0
    _, ids = softmax_topk(logits, 3, True)
    assert ids.tolist() == [[5, 0, 1]] * 3
    x = torch.randn(64, 128)
    w, ids = softmax_topk(x, 8, True)
    for i in (0, 17, 63):
        wi, idi = softmax_topk(x[i:i + 1], 8, True)
        assert torch.equal(wi[0], w[i]) and torch.equal(idi[0], ids[i])


@pytest.mark.parametrize("norm", [True, False])
def test_softmax_topk_backward(norm):
    logits = torch.randn(7, 10, dtype=torch.float64, requires_grad=True)
    g = torch.randn(7, 3, dtype=torch.float64)
    w, ids = softmax_topk(logits, 3, norm)
    (got,) = torch.autograd.grad(w, logits, g)
    ref = torch.softmax(logits, -1).gather(1, ids)
    if norm:
        ref = ref / ref.sum(-1, keepdim=True)
    (want,) = torch.autograd.grad(ref, logits, g)
    assert torch.allclose(got, want, atol=1e-12)


def test_softmax_topk_rejects_bad_k():
    with pytest.raises(ValueError, match="top_k=9"):
        softmax_topk(torch.randn(2, 8), 9, True)


def test_moe_align_groups_pairs_by_expert():
    ids = torch.tensor([[3, 1], [1, 0], [3, 3 - 2]])  # expert 1 gets three pairs
    layout = moe_align(ids, 4, block_m=4)
    pairs = layout.sorted_pairs
    assert layout.num_pairs == 6 and pairs.shape[0] % 4 == 0
    for p in range(6):
        assert pairs[layout.pair_pos[p]] == p
    flat = ids.reshape(-1)
    for b, expert in enumerate(layout.block_expert.tolist()):
        block = pairs[b * 4:(b + 1) * 4]
        real = block[block < 6]
        if expert < 0:
            assert real.numel() == 0
        else:
            assert torch.all(flat[real] == expert) and torch.equal(real, real.sort().values)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_fused_moe_matches_plain_torch(dtype):
    x = torch.randn(20, 32).to(dtype)
    gate_up, down = _weights(dtype=dtype)
    w, ids = softmax_topk(torch.randn(20, 8), 3, True)
    out = fused_moe(x, gate_up, down, w, ids)
    ref = moe_math(x.double(), gate_up.double(), down.double(), w.double(), ids)
    assert out.dtype == dtype
    assert rel_err(out, ref) < {torch.float64: 1e-13, torch.float32: 1e-6, torch.bfloat16: 2e-2}[dtype]


def test_fused_moe_tokens_invariant_to_batch_and_expert_load():
    """A token's output is bitwise the same alone or in batches where its experts see 1 or 100s of rows."""
    x = torch.randn(300, 32)
    gate_up, down = _weights()
    logits = torch.randn(300, 8)
    logits[:250, 0] += 10  # expert 0 takes most tokens; others get few or none
    w, ids = softmax_topk(logits, 2, True)
    full = fused_moe(x, gate_up, down, w, ids)
    for i in (0, 7, 260, 299):
        assert torch.equal(fused_moe(x[i:i + 1], gate_up, down, w[i:i + 1], ids[i:i + 1])[0], full[i])
    assert torch.equal(fused_moe(x[250:], gate_up, down, w[250:], ids[250:]), full[250:])


def test_pick_config_takes_short_row_blocks_for_decode_batches():
    """Up to 12 rows an expert take 16-row blocks and up to 16 rows 32-row blocks (decode batches of
    the Qwen3-30B-A3B layer, 128 experts, top-8: up to 192 / 256 sequences), as the H200 sweeps
    chose; Moonlight's 256-sequence steps (64 experts, top-6: 24 rows an expert), prefill and
    training keep 64 or 128."""
    assert [pick_config(t, 8, 128).block_m for t in (1, 192, 193, 256, 257, 4096)] == [16, 16, 32, 32, 64, 128]
    assert [pick_config(t, 6, 64).block_m for t in (1, 128, 129, 170, 171, 256, 2731)] == [16, 16, 32, 32, 64, 64, 128]
    assert pick_config(128, 8, 128) is FEW_ROWS and pick_config(256, 8, 128) is DECODE
    assert pick_config(512, 6, 64) is SMALL and pick_config(16384, 8, 128) is LARGE
    # decode tiles read 128-wide K tiles (`benchmarks/moe.py --decode`, H200, 2026-11-27); prefill and training keep 64
    assert {(c.block_k, c.down_block_k) for c in (FEW_ROWS, DECODE)} == {(128, 128)}
    assert {(c.block_k, c.down_block_k) for c in (SMALL, LARGE)} == {(64, 64)}
    # TMA descriptors where they won (prefill and training batches, `benchmarks/moe.py --sweep`, H200, 2026-11-27)
    assert [c.tma for c in (FEW_ROWS, DECODE, SMALL, LARGE)] == [False, False, False, True]


def test_expert_weights_take_tma_descriptors_only_in_their_contiguous_layout():
    """`tma_weight_layout`: HF's fused ``[E, N, K]`` bf16 experts read as ``[E * N, K]`` rows (the
    forward's gate/up and down); the backward's transposed reads, fp32, ragged rows (K * 2 bytes
    not a multiple of 16) and strided slices do not. `weights_by_tma` adds the GPU: never on CPU."""
    gate_up = torch.zeros(4, 48, 32, dtype=torch.bfloat16)
    assert tma_weight_layout(gate_up, 48, 32, gate_up.stride(1), gate_up.stride(2))
    assert not tma_weight_layout(gate_up, 32, 48, gate_up.stride(2), gate_up.stride(1))  # transposed (backward)
    assert not tma_weight_layout(gate_up.float(), 48, 32, 32, 1)
    ragged = torch.zeros(4, 48, 36, dtype=torch.bfloat16)
    assert not tma_weight_layout(ragged, 48, 36, 36, 1)
    half = gate_up[:, :24]  # every other expert's rows: a stride of 48 rows per expert
    assert not tma_weight_layout(half, 24, 32, half.stride(1), half.stride(2))
    assert not weights_by_tma(gate_up, 48, 32, 32, 1)  # CPU


def test_weight_rows_read_a_transposed_view_as_its_memory():
    """`weight_rows`: the ``[E * n, k]`` matrix a descriptor reads, for HF's contiguous ``[E, N, K]``
    experts and for a transposed view of ``[E, n, k]`` memory (GPT-OSS's down weight ``[E, I, H]``
    passed as ``[E, H, I]``, read transposed in the backward: n = I, k = H), which passes
    `tma_weight_layout` and which ``view(-1, k)`` refuses (the H200 backward failed there); an
    offset slice keeps its offset."""
    gate_up = torch.randn(4, 48, 32).to(torch.bfloat16)
    assert torch.equal(weight_rows(gate_up, 48, 32), gate_up.reshape(-1, 32))
    down = torch.randn(3, 24, 32).to(torch.bfloat16)  # [E, I, H] memory
    seen = down.transpose(1, 2)  # [E, H, I], as the model hands it over
    assert tma_weight_layout(seen, 24, 32, seen.stride(2), seen.stride(1))
    with pytest.raises(RuntimeError):
        seen.view(-1, 32)
    rows = weight_rows(seen, 24, 32)
    assert rows.shape == (72, 32) and torch.equal(rows, down.reshape(-1, 32))
    assert torch.equal(rows[1 * 24 + 5], seen[1, :, 5])  # expert 1's element (n = 5, k) at row 1 * n + 5
    stacked = torch.randn(2, 4, 48, 32).to(torch.bfloat16)
    assert torch.equal(weight_rows(stacked[1], 48, 32), stacked[1].reshape(-1, 32))


def test_k_tile_falls_back_to_64_where_128_does_not_divide_k():
    """A 128-wide tile runs only where it divides K (Moonlight's 1,408, Qwen3-30B-A3B's 768 and
    both hidden sizes of 2,048): over a ragged K it would add masked zero products that the
    64-wide tiles do not, and +0.0 turns a sum of -0.0 into +0.0."""
    assert [k_tile(128, k) for k in (2048, 1408, 768, 128)] == [128] * 4
    assert [k_tile(128, k) for k in (96, 192, 1344, 64)] == [64] * 4
    assert [k_tile(64, k) for k in (96, 2048)] == [64, 64]


def test_fused_moe_backward_matches_autograd():
    x = torch.randn(9, 16, dtype=torch.float64, requires_grad=True)
    gate_up, down = (t.double().requires_grad_() for t in _weights(experts=4, hidden=16, inter=8))
    w = torch.rand(9, 2, dtype=torch.float64, requires_grad=True)
    ids = torch.randint(0, 4, (9, 2))
    g = torch.randn(9, 16, dtype=torch.float64)
    got = torch.autograd.grad(fused_moe(x, gate_up, down, w, ids), (x, gate_up, down, w), g)
    want = torch.autograd.grad(moe_math(x, gate_up, down, w, ids), (x, gate_up, down, w), g)
    for a, b in zip(got, want):
        assert torch.allclose(a, b, atol=1e-10)


def test_fused_moe_add_is_the_plain_sum_with_and_without_gradients():
    """`add` (DeepSeek's shared experts) gives bitwise ``fused_moe(...) + add`` on the reference
    path, and its gradient is the output's."""
    x = torch.randn(20, 32).bfloat16()
    gate_up, down = _weights(dtype=torch.bfloat16)
    w, ids = softmax_topk(torch.randn(20, 8), 3, True)
    add = (torch.randn(20, 32) * 100).bfloat16()
    assert torch.equal(fused_moe(x, gate_up, down, w, ids, add=add), fused_moe(x, gate_up, down, w, ids) + add)
    add = add.requires_grad_()
    out = fused_moe(x, gate_up, down, w, ids, add=add)
    assert torch.equal(out, fused_moe(x, gate_up, down, w, ids) + add)
    g = torch.randn(20, 32).bfloat16()
    assert torch.equal(torch.autograd.grad(out, add, g)[0], g)


def test_fused_moe_shape_errors():
    gate_up, down = _weights()
    with pytest.raises(ValueError, match="do not fit"):
        fused_moe(torch.randn(2, 31), gate_up, down, torch.ones(2, 1), torch.zeros(2, 1, dtype=torch.long))
    with pytest.raises(ValueError, match="must both be"):
        fused_moe(torch.randn(2, 32), gate_up, down, torch.ones(2, 2), torch.zeros(2, 1, dtype=torch.long))
    with pytest.raises(ValueError, match=r"add must be \[2, 32\] torch.float32 on cpu like x; got \(2, 31\)"):
        fused_moe(torch.randn(2, 32), gate_up, down, torch.ones(2, 1), torch.zeros(2, 1, dtype=torch.long),
                  add=torch.zeros(2, 31))


def test_fused_moe_adapter_errors_name_the_adapter_and_its_shapes():
    from vexact_models.kernels import ExpertLora

    gate_up, down = _weights()
    experts, inter2, hidden = gate_up.shape
    x, w, ids = torch.randn(2, hidden), torch.ones(2, 1), torch.zeros(2, 1, dtype=torch.long)
    good = ExpertLora(torch.zeros(experts * 2, hidden), torch.zeros(inter2, 2 * experts), 1.0)
    assert torch.equal(fused_moe(x, gate_up, down, w, ids, gate_up_lora=good), fused_moe(x, gate_up, down, w, ids))
    with pytest.raises(ValueError, match=rf"gate_up_lora: lora A \({experts * 2 + 1}, {hidden}\) and B .* do not fit "
                                         rf"{experts} experts of \[N={inter2}, K={hidden}\]"):
        fused_moe(x, gate_up, down, w, ids, gate_up_lora=ExpertLora(torch.zeros(experts * 2 + 1, hidden),
                                                                      torch.zeros(inter2, 2 * experts), 1.0))
    with pytest.raises(ValueError, match=r"down_lora: lora A .* do not fit"):  # gate_up's adapter on down
        fused_moe(x, gate_up, down, w, ids, down_lora=good)
    with pytest.raises(ValueError, match=r"gate_up_lora: lora B is torch.float16 on cpu; want fp32 or torch.float32"):
        fused_moe(x, gate_up, down, w, ids, gate_up_lora=ExpertLora(good.a, good.b.half(), 1.0))
    with pytest.raises(ValueError, match=r"down_lora=\(1, 2\) must be a kernels.moe_lora.ExpertLora or None"):
        fused_moe(x, gate_up, down, w, ids, down_lora=(1, 2))


def test_adapter_b_by_expert_is_each_experts_b_in_peft_layout():
    """`ExpertLora.b_by_expert` regroups PEFT's ``[N, r * E]`` (rank j of expert e at column j * E + e)
    into ``[E, N, r]`` contiguous: entry e is `expert_b(e)`; a copy, so B changed in place later is
    read again at the next call."""
    from vexact_models.kernels import ExpertLora

    experts, rank, n = 5, 3, 7
    lora = ExpertLora(torch.zeros(experts * rank, 4), torch.randn(n, rank * experts), 2.0)
    grouped = lora.b_by_expert(experts)
    assert grouped.shape == (experts, n, rank) and grouped.is_contiguous()
    for e in range(experts):
        assert torch.equal(grouped[e], lora.expert_b(e, experts))
    assert torch.equal(grouped[2, 4], torch.tensor([lora.b[4, j * experts + 2] for j in range(rank)]))
    lora.b.add_(1.0)
    assert torch.equal(lora.b_by_expert(experts), grouped + 1.0)


def test_kept_b_copies_are_refreshed_in_place_and_found_by_storage():
    """`KeptExpertB` copies each B by expert (`ExpertLora.b_by_expert`'s values) and finds it by B's
    storage, shape, strides, dtype and the expert count; `refresh` copies B again into the same
    address (CUDA graphs read it) and adds new sources, and drops nothing."""
    from vexact_models.kernels import ExpertLora, KeptExpertB

    experts, rank, n = 6, 4, 5
    lora = ExpertLora(torch.zeros(experts * rank, 8), torch.randn(n, rank * experts), 1.0)
    kept = KeptExpertB([(lora.b, experts)])
    copy = kept.copy_of(lora.b, experts)
    assert torch.equal(copy, lora.b_by_expert(experts)) and copy.is_contiguous()
    assert len(kept) == 1 and kept.nbytes == lora.b.numel() * 4
    lora.b.add_(1.0)
    assert not torch.equal(copy, lora.b_by_expert(experts))  # a copy: stale until refreshed
    kept.refresh()
    assert kept.copy_of(lora.b, experts) is copy and torch.equal(copy, lora.b_by_expert(experts))
    assert kept.copy_of(lora.b, 3) is None and kept.copy_of(lora.b.clone(), experts) is None
    assert kept.copy_of(lora.b.t().contiguous().t(), experts) is None  # other strides
    other = torch.randn(n, rank * experts, dtype=torch.bfloat16)
    kept.refresh([(other, experts), (lora.b, experts)])
    assert len(kept) == 2 and kept.copy_of(lora.b, experts) is copy
    assert torch.equal(kept.copy_of(other, experts), ExpertLora(lora.a, other, 1.0).b_by_expert(experts))


def test_kept_b_refresh_drops_b_no_longer_adapted_and_stays_within_its_limit():
    """`refresh(only=True)` drops the copies of a B not among the sources (a replaced storage, an
    adapter gone) and lets go of that B; `limit` keeps the copies' bytes within it: a B past it is
    not kept (its forwards copy B per call), whatever came first, and 0 keeps none."""
    from vexact_models.kernels import KeptExpertB
    from vexact_models.kernels.expert_lora import view_by_expert

    experts, rank, n = 6, 4, 5
    first, second = torch.randn(n, rank * experts), torch.randn(n, rank * experts)
    size = first.numel() * first.element_size()
    kept = KeptExpertB([(first, experts), (second, experts)])
    held = kept.copy_of(second, experts)
    replaced = first.clone()
    kept.refresh([(replaced, experts), (second, experts)])  # no `only`: the old copy stays (a graph may read it)
    assert len(kept) == 3 and kept.copy_of(first, experts) is not None
    kept.refresh([(replaced, experts), (second, experts)], only=True)
    assert len(kept) == 2 and kept.nbytes == 2 * size and kept.copy_of(second, experts) is held
    assert kept.copy_of(first, experts) is None  # its entry, which held the replaced storage, is gone
    assert torch.equal(kept.copy_of(replaced, experts), view_by_expert(replaced, experts))
    kept.refresh([], only=True)
    assert len(kept) == 0
    third = torch.randn(n, rank * experts)
    kept.refresh([(replaced, experts), (second, experts), (third, experts)], limit=2 * size - 1)
    assert len(kept) == 1 and kept.copy_of(replaced, experts) is not None and kept.nbytes == size
    kept.refresh([(second, experts), (third, experts)], limit=2 * size)
    assert len(kept) == 2 and kept.copy_of(second, experts) is not None and kept.copy_of(third, experts) is None
    assert len(KeptExpertB()) == 0
    none = KeptExpertB()
    none.refresh([(second, experts)], limit=0)
    assert len(none) == 0 and none.nbytes == 0


def test_expert_b_operand_reads_the_kept_copy_only_within_reading_kept_b():
    """Within `reading_kept_b` the expand's B is the kept copy at any pair count (the copy costs no
    launch there); outside it, in another thread, with ``None`` or an explicit `regroup`, the
    per-call choice (`copies_b`: PEFT's B in place for few pairs)."""
    import threading

    from vexact_models.kernels import ExpertLora, KeptExpertB, reading_kept_b
    from vexact_models.kernels.expert_lora import expert_b_operand

    experts, rank, n = 6, 4, 5
    lora = ExpertLora(torch.zeros(experts * rank, 8), torch.randn(n, rank * experts), 1.0)
    kept = KeptExpertB([(lora.b, experts)])
    assert expert_b_operand(lora, experts, 1)[0] is lora.b
    with reading_kept_b(kept):
        b, strides = expert_b_operand(lora, experts, 1)
        assert b is kept.copy_of(lora.b, experts) and strides == b.stride()
        assert expert_b_operand(lora, experts, 1, regroup=False)[0] is lora.b
        assert expert_b_operand(ExpertLora(lora.a, lora.b.clone(), 1.0), experts, 1)[0] is not b  # not kept
        seen = []
        thread = threading.Thread(target=lambda: seen.append(expert_b_operand(lora, experts, 1)[0]))
        thread.start()
        thread.join()
        assert seen[0] is lora.b  # the block is this thread's: a trainer's thread reads B itself
        with reading_kept_b(None):
            assert expert_b_operand(lora, experts, 1)[0] is lora.b
    assert expert_b_operand(lora, experts, 1)[0] is lora.b


def test_launch_warps_takes_the_default_or_a_warp_count_triton_launches():
    from vexact_models.kernels._triton import launch_warps

    assert launch_warps("op", None, 4) == 4 and launch_warps("op", 1, 4) == 1
    with pytest.raises(ValueError, match="op: num_warps=3 must be 1, 2, 4 or 8"):
        launch_warps("op", 3, 4)


def test_the_backward_picks_its_expert_gemms_by_the_switch_and_the_operands():
    """``auto`` takes torch's grouped GEMM only for bf16 on a Hopper-class GPU (ours on CPU); a forced
    grouped_mm refuses fp32 operands naming the switch; triton is always ours."""
    from vexact_models.kernels.moe_backward import expert_gemms, use_moe_backward

    bf16, fp32 = torch.zeros(2, 2, dtype=torch.bfloat16), torch.zeros(2, 2)
    assert expert_gemms(bf16, bf16) == "triton"  # (auto, on the CPU)
    with use_moe_backward("grouped_mm"):
        assert expert_gemms(bf16, bf16) == "grouped_mm"
        with pytest.raises(ValueError, match=r"VEXACT_MOE_BACKWARD=grouped_mm needs bf16 operands .*torch.float32"):
            expert_gemms(bf16, fp32)
    with use_moe_backward("triton"):
        assert expert_gemms(bf16, bf16) == "triton"
