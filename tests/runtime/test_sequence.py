"""Sequence bookkeeping: token counts and properties."""

import pytest

from vexact_models.runtime.sampling_params import SamplingParams
from vexact_models.runtime.sequence import Sequence, SequenceStatus


def test_properties_track_prompt_and_outputs():
    prompt = [5, 6, 7]
    seq = Sequence(request_id=3, sample_index=1, prompt_token_ids=prompt,
                   params=SamplingParams(n=2), seed=11)
    assert seq.status is SequenceStatus.WAITING and not seq.is_finished
    assert (seq.num_tokens, seq.num_prompt_tokens, seq.num_output_tokens) == (3, 3, 0)
    assert seq.num_uncomputed_tokens == 3 and seq.last_token == 7
    seq.num_computed_tokens = 3
    seq.append_token(9, -0.25)
    assert prompt == [5, 6, 7]  # the caller's list is not modified
    assert seq.token_ids == [5, 6, 7, 9] and seq.output_token_ids == [9]
    assert seq.output_logprobs == [-0.25]
    assert (seq.num_output_tokens, seq.num_uncomputed_tokens, seq.last_token) == (1, 1, 9)
    seq.status = SequenceStatus.FINISHED
    assert seq.is_finished
    with pytest.raises(RuntimeError, match="finished"):
        seq.append_token(1, 0.0)


def test_seq_ids_are_unique_and_increasing():
    ids = [Sequence(0, 0, [1], SamplingParams(), 0).seq_id for _ in range(5)]
    assert ids == sorted(set(ids))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"prompt_token_ids": []}, "must not be empty"),
        ({"sample_index": 2}, "sample_index=2 is outside [0, 2)"),
        ({"seed": -1}, "seed=-1 is outside [0, 2**63)"),
    ],
)
def test_invalid_sequences_are_rejected(kwargs, message):
    args = {"request_id": 0, "sample_index": 0, "prompt_token_ids": [1],
            "params": SamplingParams(n=2), "seed": 0, **kwargs}
    with pytest.raises(ValueError) as info:
        Sequence(**args)
    assert message in str(info.value)
