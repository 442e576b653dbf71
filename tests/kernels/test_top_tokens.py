"""`kernels.top_tokens` on the reference backend: each row's k largest logits by token id (equal
logits: the lower id first), the given token's rank (1 + the logits above it), a row's result
independent of its batch, and bad input refused (its Triton kernel against this reference:
tests/triton_checks/check_top_tokens.py)."""

import pytest
import torch

from vexact_models.kernels import top_tokens


def test_the_k_largest_logits_in_order_and_the_rank_of_each_rows_own_token():
    torch.manual_seed(0)
    logits = torch.randn(4, 700)
    logits[1, [5, 9, 600]] = 50.0  # a tie at the top: the lower ids first
    logits[2, :3] = torch.tensor([0.0, -0.0, float("-inf")])
    own = torch.tensor([3, 600, 2, 17])
    tokens, ranks = top_tokens(logits, own, 6)
    assert torch.equal(logits.gather(1, tokens), logits.topk(6, dim=1).values)  # the k largest, highest first
    assert tokens[1, :3].tolist() == [5, 9, 600]
    assert torch.equal(ranks, (logits > logits.gather(1, own[:, None])).sum(1) + 1)
    assert ranks[1] == 1 and ranks[2] == 700  # tied at the top; the -inf below every other logit
    assert top_tokens(logits, own, 0)[0].shape == (4, 0) and torch.equal(top_tokens(logits, own, 0)[1], ranks)


def test_a_rows_tokens_and_rank_do_not_depend_on_its_batch():
    torch.manual_seed(1)
    logits, own = torch.randn(5, 300), torch.randint(0, 300, (5,))
    tokens, ranks = top_tokens(logits, own, 20)
    for i in range(5):
        one = top_tokens(logits[i:i + 1], own[i:i + 1], 20)
        assert torch.equal(one[0][0], tokens[i]) and one[1][0] == ranks[i]


@pytest.mark.parametrize("args, words", [
    ((torch.zeros(2, 9, dtype=torch.float16), torch.zeros(2), 1), "logits must be fp32 [rows, vocab]"),
    ((torch.zeros(2, 9), torch.zeros(3), 1), "own must be [2]"),
    ((torch.zeros(2, 9), torch.zeros(2), 10), "k=10 must be an int in [0, 9]"),
    ((torch.zeros(2, 9), torch.zeros(2), True), "k=True must be an int"),
])
def test_bad_input_is_refused_naming_it(args, words):
    with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
        top_tokens(*args)
