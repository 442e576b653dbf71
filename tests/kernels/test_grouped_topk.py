import pytest
import torch
from transformers import DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

from vexact_models.kernels import exact_math
from vexact_models.kernels.grouped_topk import sigmoid_grouped_topk, sigmoid_grouped_topk_reference

# (experts, top_k, n_group, topk_group, norm, scale)
DEEPSEEK_V3 = (32, 8, 8, 4, True, 2.5)  # DeepSeek-V3's grouping at 1/8 of its 256 experts
MOONLIGHT = (64, 6, 1, 1, True, 2.446)
UNNORMALISED = (48, 4, 4, 2, False, 1.5)


def _hf_router(experts, top_k, n_group, topk_group, norm, scale, hidden=16):
    config = DeepseekV3Config(n_routed_experts=experts, num_experts_per_tok=top_k, n_group=n_group,
                              topk_group=topk_group, norm_topk_prob=norm, routed_scaling_factor=scale,
                              hidden_size=hidden)
    router = DeepseekV3TopkRouter(config)
    with torch.no_grad():
        router.weight.copy_(torch.randn(experts, hidden))
    return router


def _check_against_hf(router, bias, tokens=40):
    with torch.no_grad():
        router.e_score_correction_bias.copy_(bias)
        logits, hf_w, hf_ids = router(torch.randn(tokens, router.hidden_dim))
    w, ids = sigmoid_grouped_topk(logits, bias, router.top_k, router.num_group, router.topk_group,
                                  router.norm_topk_prob, router.routed_scaling_factor)
    assert w.dtype == torch.float32 and ids.dtype == torch.int64 and ids.shape == hf_ids.shape
    hf_order, order = hf_ids.argsort(1), ids.argsort(1)  # HF's topk is unsorted: compare per id
    assert torch.equal(ids.gather(1, order), hf_ids.gather(1, hf_order))
    assert torch.allclose(w.gather(1, order), hf_w.gather(1, hf_order), rtol=1e-6, atol=1e-7)
    choice = torch.sigmoid(logits) + bias  # rank 0 first
    assert torch.all(choice.gather(1, ids).diff(dim=1) <= 0)
    return ids


@pytest.mark.parametrize("case", [DEEPSEEK_V3, MOONLIGHT, UNNORMALISED], ids=["dsv3", "moonlight", "unnorm"])
def test_matches_hf_router(case):
    router = _hf_router(*case)
    _check_against_hf(router, torch.zeros(case[0]))


@pytest.mark.parametrize("case", [DEEPSEEK_V3, MOONLIGHT], ids=["dsv3", "moonlight"])
def test_bias_changes_selection_like_hf(case):
    router = _hf_router(*case)
    state = torch.get_rng_state()
    unbiased = _check_against_hf(router, torch.zeros(case[0]))
    torch.set_rng_state(state)  # same tokens, now with a bias
    biased = _check_against_hf(router, torch.randn(case[0]) * 0.3)
    assert not torch.equal(biased.sort(1).values, unbiased.sort(1).values)


def test_a_bf16_bias_is_its_fp32_value():
    logits, bias = torch.randn(40, 32), (torch.randn(32) * 0.3).bfloat16()
    got = sigmoid_grouped_topk(logits, bias, *DEEPSEEK_V3[1:])
    want = sigmoid_grouped_topk(logits, bias.float(), *DEEPSEEK_V3[1:])
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_groups_of_one_and_ties_take_lowest_index():
    w, ids = sigmoid_grouped_topk(torch.zeros(2, 8), torch.zeros(8), 3, 4, 2, False, 1.0)
    assert ids.tolist() == [[0, 1, 2]] * 2 and torch.equal(w, torch.full((2, 3), 0.5))
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])  # groups of one: score = the value itself
    _, ids = sigmoid_grouped_topk(logits, torch.zeros(4), 2, 4, 2, True, 1.0)
    assert ids.tolist() == [[1, 3]]
    # group 0 holds the best expert but group 1 the best pair: group 0 is dropped
    logits = torch.tensor([[5.0, -5.0, 1.0, 1.0, 0.0, 0.0]])
    _, ids = sigmoid_grouped_topk(logits, torch.zeros(6), 2, 3, 1, True, 1.0)
    assert ids.tolist() == [[2, 3]]


def test_rows_are_batch_invariant():
    experts, top_k, n_group, topk_group, norm, scale = DEEPSEEK_V3
    x, bias = torch.randn(200, experts), torch.randn(experts) * 0.1
    w, ids = sigmoid_grouped_topk(x, bias, top_k, n_group, topk_group, norm, scale)
    for i in (0, 17, 199):
        wi, idi = sigmoid_grouped_topk(x[i:i + 1], bias, top_k, n_group, topk_group, norm, scale)
        assert torch.equal(wi[0], w[i]) and torch.equal(idi[0], ids[i])
    w2, ids2 = sigmoid_grouped_topk(x[50:], bias, top_k, n_group, topk_group, norm, scale)
    assert torch.equal(w2, w[50:]) and torch.equal(ids2, ids[50:])


@pytest.mark.parametrize("norm", [True, False])
def test_backward_matches_autograd(norm):
    logits = torch.randn(9, 24, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(24, dtype=torch.float64, requires_grad=True)
    g = torch.randn(9, 4, dtype=torch.float64)
    w, ids = sigmoid_grouped_topk(logits, bias, 4, 6, 3, norm, 2.5)
    (got,) = torch.autograd.grad(w, logits, g)
    assert bias.grad is None
    picked = torch.sigmoid(logits).gather(1, ids)  # same fixed selection, autograd through it
    if norm:
        picked = picked / (picked.sum(-1, keepdim=True) + 1e-20)
    (want,) = torch.autograd.grad(picked * 2.5, logits, g)
    assert torch.allclose(got, want, atol=1e-12)
    assert torch.count_nonzero(got) == 9 * 4  # only the picked experts get gradient
    x = logits.detach().clone().requires_grad_()
    assert torch.autograd.gradcheck(lambda t: sigmoid_grouped_topk(t, bias, 4, 6, 3, norm, 2.5)[0], (x,))


def test_reference_returns_picked_scores():
    x, bias = torch.randn(5, 16), torch.randn(16)
    w, ids, sel = sigmoid_grouped_topk_reference(x, bias, 3, 4, 2, False, 2.0)
    assert torch.equal(w, sel * 2.0) and torch.equal(sel, exact_math.sigmoid(x).gather(1, ids))


@pytest.mark.parametrize("shape,bias,args,match", [
    ((4,), (4,), (2, 2, 1), "router_logits must be"),
    ((2, 8), (7,), (2, 2, 1), r"e_score_correction_bias must have shape \(8,\)"),
    ((2, 8), (8,), (2, 3, 1), "n_group=3 must be >= 1 and divide the 8 experts"),
    ((2, 8), (8,), (2, 0, 1), "n_group=0"),
    ((2, 8), (8,), (2, 4, 5), r"topk_group=5 must be in \[1, n_group=4\]"),
    ((2, 8), (8,), (2, 4, 0), "topk_group=0"),
    ((2, 8), (8,), (5, 4, 2), r"top_k=5 must be in \[1, 4\]"),
    ((2, 8), (8,), (0, 4, 2), "top_k=0"),
])
def test_rejects_bad_arguments(shape, bias, args, match):
    top_k, n_group, topk_group = args
    with pytest.raises(ValueError, match=match):
        sigmoid_grouped_topk(torch.randn(shape), torch.zeros(bias), top_k, n_group, topk_group, True, 1.0)


@pytest.mark.parametrize("case", [DEEPSEEK_V3, MOONLIGHT], ids=["dsv3", "moonlight"])
def test_nan_row_picks_in_range_experts_and_leaves_others_alone(case):
    """A CUDA-graph padding row attends over nothing and its logits are NaN: the router must
    still return valid expert ids (the MoE kernels index with them)."""
    experts, top_k, n_group, topk_group, norm, scale = case
    logits, bias = torch.randn(5, experts), torch.randn(experts) * 0.05
    nan = logits.clone()
    nan[2] = float("nan")
    w, ids = sigmoid_grouped_topk(nan, bias, top_k, n_group, topk_group, norm, scale)
    assert int(ids.min()) >= 0 and int(ids.max()) < experts and len(set(ids[2].tolist())) == top_k
    w_ok, ids_ok = sigmoid_grouped_topk(logits, bias, top_k, n_group, topk_group, norm, scale)
    keep = torch.tensor([0, 1, 3, 4])
    assert torch.equal(ids[keep], ids_ok[keep]) and torch.equal(w[keep], w_ok[keep])
