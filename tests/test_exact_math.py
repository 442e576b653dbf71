import torch

from vexact_models.kernels import exact_math


def test_exp_log_match_float64_rounded():
    x = torch.randn(200_000) * 30
    assert torch.equal(exact_math.exp(x), torch.exp(x.double()).float())
    y = x.abs() * 7 + 1e-30
    assert torch.equal(exact_math.log(y), torch.log(y.double()).float())


def test_exp_log_special_values():
    e = exact_math.exp(torch.tensor([float("-inf"), 0.0, float("inf"), 1000.0, -1000.0]))
    assert e.tolist() == [0.0, 1.0, float("inf"), float("inf"), 0.0]
    lg = exact_math.log(torch.tensor([0.0, 1.0, float("inf"), -1.0]))
    assert lg[0] == float("-inf") and lg[1] == 0.0 and lg[2] == float("inf") and torch.isnan(lg[3])


def test_elementwise_results_do_not_depend_on_position():
    x = torch.randn(4099) * 10
    for fn in (exact_math.exp, exact_math.sigmoid, lambda t: exact_math.log(t.abs() + 1e-3)):
        full = fn(x)
        single = torch.stack([fn(x[i:i + 1])[0] for i in range(0, 4099, 13)])
        assert torch.equal(full[::13], single)


def test_row_sum_is_independent_of_row_count():
    # 151,936 columns: torch's own sum splits a lone row of this length across threads, so the
    # test runs with two whatever the environment asks (.ci/run sets OMP_NUM_THREADS=1).
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        rows = torch.randn(5, 151_936)
        together = exact_math.row_sum(rows)
        for i in range(5):
            assert torch.equal(exact_math.row_sum(rows[i:i + 1])[0], together[i])
    finally:
        torch.set_num_threads(before)
    assert abs(float(together[0]) - float(rows[0].double().sum())) < 1e-2


def test_softmax_and_logsumexp_match_float64():
    x = torch.randn(7, 300) * 4
    assert torch.allclose(exact_math.softmax(x), torch.softmax(x.double(), -1).float(), rtol=1e-6, atol=1e-7)
    assert torch.allclose(exact_math.logsumexp(x), torch.logsumexp(x.double(), -1).float(), rtol=1e-6)


def test_dot_rows_is_the_whole_product_however_the_rows_are_grouped(monkeypatch):
    """`dot_rows` (the linear, per-head linear and LoRA references' GEMM) gives the values of one
    `dot` over every row at once, for any `PRODUCT_ELEMENTS`: a group of one row, of a few, of
    all; with a lead dimension (per head) too; and a K over `REDUCE_BLOCK` sums in blocks."""
    torch.manual_seed(0)
    cases = [(torch.randn(37, 96), torch.randn(40, 96)),  # [M, K] . [N, K]^T
             (torch.randn(11, 3, 64), torch.randn(3, 24, 64)),  # [M, H, K] . [H, N, K]^T
             (torch.randn(5, 4100), torch.randn(6, 4100))]  # K past REDUCE_BLOCK
    for x, w in cases:
        whole = exact_math.dot(x.unsqueeze(-2), w.unsqueeze(0))
        assert whole.shape == (x.shape[0], *w.shape[:-1])
        for elements in (1, w.numel() * 4, 1 << 30):
            monkeypatch.setattr(exact_math, "PRODUCT_ELEMENTS", elements)
            assert torch.equal(exact_math.dot_rows(x, w), whole), (x.shape, elements)
    ref = exact_math.dot_rows(cases[0][0].double(), cases[0][1].double())
    assert torch.allclose(ref.float(), cases[0][0] @ cases[0][1].T, rtol=1e-5, atol=1e-5)
