"""Scheduler.postprocess finishing rules: stop ids, EOS, ignore_eos, min/max tokens,
max_model_len; finished sequences free their pages."""

import pytest

from vexact_models.runtime.block_manager import BlockManager
from vexact_models.runtime.sampling_params import SamplingParams
from vexact_models.runtime.scheduler import Scheduler
from vexact_models.runtime.sequence import Sequence, SequenceStatus

EOS = 2


def run_scripted(script, prompt_len=3, max_model_len=64, eos=EOS, **params):
    """Feed ``script``'s tokens one per sampling step; returns the finished sequence."""
    bm = BlockManager(32, 4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=16,
                      max_model_len=max_model_len, eos_token_id=eos)
    seq = Sequence(0, 0, [9] * prompt_len, SamplingParams(**params), seed=0)
    sched.add(seq)
    feed = iter(script)
    finished = []
    while sched.has_unfinished():
        out = sched.schedule()
        (item,) = out.scheduled
        token = next(feed) if item.samples else None
        finished += sched.postprocess(out.scheduled, [token], [-0.5 if item.samples else None])
    assert finished == [seq] and seq.status is SequenceStatus.FINISHED
    assert seq.block_table == [] and bm.num_free_blocks == bm.num_blocks
    assert len(seq.output_logprobs) == seq.num_output_tokens
    return seq


@pytest.mark.parametrize(
    "script, params, outputs, reason",
    [
        ([5, EOS, 6], {}, [5, EOS], "stop"),
        ([EOS], {}, [EOS], "stop"),
        ([5, EOS, 6], {"ignore_eos": True, "max_tokens": 3}, [5, EOS, 6], "length"),
        ([5, 7, 6], {"stop_token_ids": [7]}, [5, 7], "stop"),
        ([5, 7, 6], {"stop_token_ids": [7], "ignore_eos": True}, [5, 7], "stop"),
        ([5, 6, 8, 4], {"max_tokens": 3}, [5, 6, 8], "length"),
        ([5, EOS], {"max_tokens": 2}, [5, EOS], "stop"),  # stop wins at the last token
        # min_tokens=2: a stop token counts once 2 outputs precede it; before that the sampler bans
        # it, so it can only come from a row with nothing samplable: an error
        ([5, 6, EOS], {"min_tokens": 2}, [5, 6, EOS], "stop"),
        ([5, EOS, 6, 1], {"min_tokens": 2, "max_tokens": 4}, [5, EOS], "error"),
        ([7], {"min_tokens": 2, "stop_token_ids": [7]}, [7], "error"),
        ([EOS, 4], {"min_tokens": 2, "ignore_eos": True, "max_tokens": 2}, [EOS, 4], "length"),  # EOS not banned
        ([5, 6, 7], {"min_tokens": 2, "stop_token_ids": [7]}, [5, 6, 7], "stop"),
        # a token outside allowed_token_ids comes from a row with nothing samplable too
        ([5, 6], {"allowed_token_ids": [5]}, [5, 6], "error"),
        ([5, 5, 5], {"allowed_token_ids": [5], "max_tokens": 3}, [5, 5, 5], "length"),
    ],
)
def test_finish_rules(script, params, outputs, reason):
    seq = run_scripted(script, **params)
    assert seq.output_token_ids == outputs and seq.finish_reason == reason


def test_a_token_no_setting_allowed_ends_the_sequence_with_an_error_naming_why():
    seq = run_scripted([5, EOS], min_tokens=3)
    assert seq.error == ("output 1 of request 0: stop token 2 came before min_tokens=3: the request's structured_outputs, "
                         "allowed_token_ids, bad_words and min_tokens (which bans stop tokens and EOS) excluded every "
                         "token at this step")
    assert "token 6 is not in allowed_token_ids" in run_scripted([6], allowed_token_ids=[5, 7]).error


def test_a_stop_token_is_the_stop_reason_and_the_models_eos_is_none():
    assert run_scripted([5, 7], stop_token_ids=[7]).stop_reason == 7
    assert run_scripted([5, EOS], stop_token_ids=[EOS]).stop_reason is None  # the model's own EOS first, as vLLM's
    assert run_scripted([5, EOS], stop_token_ids=[EOS], ignore_eos=True).stop_reason == EOS


class _EndsAt:
    """A grammar (`GrammarState`'s two members the scheduler reads) that accepts every token and is
    complete once it accepted `end`."""

    def __init__(self, end: int) -> None:
        self.end, self.terminated = end, False

    def accept(self, token: int) -> bool:
        self.terminated = token == self.end
        return True


@pytest.mark.parametrize("end, reason", [(EOS, None), (7, 7)])
def test_a_grammar_ended_by_another_eos_id_reports_it_as_vllm_does(monkeypatch, end, reason):
    """A structured output's grammar ends at one of the checkpoint's EOS ids: the model's own EOS
    gives no stop_reason, another (a stop token of the request) is the stop_reason."""
    made = Sequence.__init__

    def with_grammar(self, *args, **kwargs):
        made(self, *args, **kwargs)
        self.grammar = _EndsAt(end)

    monkeypatch.setattr(Sequence, "__init__", with_grammar)
    seq = run_scripted([5, end, 6], stop_token_ids=[7])
    assert seq.output_token_ids == [5, end] and (seq.finish_reason, seq.stop_reason) == ("stop", reason)


def test_no_eos_token_means_only_stop_ids_and_lengths_finish():
    seq = run_scripted([EOS, EOS, EOS], eos=None, max_tokens=3)
    assert seq.output_token_ids == [EOS] * 3 and seq.finish_reason == "length"


def test_max_model_len_caps_the_total_length():
    seq = run_scripted([5] * 20, prompt_len=5, max_model_len=8, max_tokens=100)
    assert seq.num_tokens == 8 and seq.num_output_tokens == 3 and seq.finish_reason == "length"


def test_prefill_chunks_do_not_sample():
    # 40 prompt tokens, budget 16: chunks 16, 16, 8; only the third samples.
    seq = run_scripted([5, 6], prompt_len=40, max_tokens=2)
    assert seq.output_token_ids == [5, 6] and seq.output_logprobs == [-0.5, -0.5]
