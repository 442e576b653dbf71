"""vLLM's ``bad_words`` (`runtime.bad_words`): words are tokenized as vLLM does; every sampled
token is the one the definition picks (the training forward's logits, biased, each bad word's last
token at -inf right after its other tokens among the outputs, then the sampler's Gumbel-max at its
seed and index); no output holds a bad word; a request's tokens do not depend on its batch, the
cache, preemption or the graphs, with steps launched ahead (sampling after the host for longer words);
the reported logprobs stay the unedited ones; bad input is refused before anything runs."""

import pytest
import torch
from transformers import AutoTokenizer

from vexact_models.runtime import LLM, SamplingParams
from vexact_models.runtime.bad_words import BadWords, bad_word_ids
from vexact_models.runtime.sequence import Sequence

from .llm_support import (count_waiting_samples, gen, sampled_by_definition, save_bpe_checkpoint, tokens_four_ways,
                          training_logits, training_logprobs)

YES, SPACE_YES, NO, SPACE_NO, WAY = 271, 278, 265, 274, 277  # the tokens of "yes", " yes", "no", " no", " way"
#: "yes", "no" and " way" made likely, so that the bad words would come up without the bans
BIAS = {YES: 4.0, SPACE_YES: 4.0, NO: 5.0, WAY: 5.0}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_bpe_checkpoint(tmp_path_factory.mktemp("bad_words"))


def _engine(folder, **kwargs) -> LLM:
    return LLM(str(folder), **dict(dict(device="cpu", block_size=4, kv_cache_bytes=1 << 20, max_num_batched_tokens=64),
                                   **kwargs))


def _params(i: int, words: list[str], **extra) -> SamplingParams:
    return SamplingParams(temperature=[1.0, 0.0, 0.8][i % 3], max_tokens=16, seed=90 + i, ignore_eos=True,
                          logit_bias=BIAS, bad_words=words, **extra)


def _forbidden(tokens: list[int], sequences: list[tuple[int, ...]]) -> bool:
    """Whether `tokens` hold one of `sequences`."""
    return any(tuple(tokens[i:i + len(s)]) == s for s in sequences for i in range(len(tokens) - len(s) + 1))


def _definition_tokens(model, prompt: list[int], tokens: list[int], p: SamplingParams,
                       sequences: list[tuple[int, ...]]) -> list[int]:
    x = training_logits(model, prompt, tokens)
    for token, bias in p.logit_bias.items():
        x[:, token] += bias
    for i in range(len(tokens)):
        for s in sequences:
            if len(s) - 1 <= i and tuple(tokens[i - len(s) + 1:i]) == s[:-1]:
                x[i, s[-1]] = float("-inf")
    return sampled_by_definition(x, prompt, tokens, p)


def test_words_are_tokenized_as_vllm_does(folder):
    tok = AutoTokenizer.from_pretrained(folder)

    def enc(text: str) -> tuple[int, ...]:
        return tuple(tok.encode(text, add_special_tokens=False))

    assert enc("yes") == (YES,) and enc(" yes") == (SPACE_YES,)  # one token either way: both
    assert bad_word_ids(tok, ["yes"], 512) == [(YES,), (SPACE_YES,)]
    assert len(enc(" hi")) == 2 and bad_word_ids(tok, ["  hi"], 512) == [enc("hi")]  # longer after a space: as written
    assert bad_word_ids(tok, ["no way"], 512) == [(NO, WAY), (SPACE_NO, WAY)]
    with pytest.raises(ValueError, match=r"bad_words entry 'yes' tokenizes to id 271, outside the model's vocabulary "
                                         r"\[0, 100\)"):
        bad_word_ids(tok, ["yes"], 100)


def test_sampled_tokens_are_the_definitions_and_no_output_holds_a_bad_word(folder):
    llm = _engine(folder)
    model = llm.model.causal_lm
    words = ["yes", "no way"]
    sequences = bad_word_ids(llm.tokenizer, words, 512)
    prompts = ["no", "say", "abc", "yes", "(a", "12"]
    params = [_params(i, words) for i in range(6)]
    outs = gen(llm, prompts, params)
    free = gen(llm, prompts, [_params(i, []) for i in range(6)])
    assert sum(_forbidden(o.outputs[0].token_ids, sequences) for o in free) >= 3  # the bans matter
    for out, p in zip(outs, params):
        c = out.outputs[0]
        assert not _forbidden(c.token_ids, sequences) and c.finish_reason == "length"
        assert c.token_ids == _definition_tokens(model, out.prompt_token_ids, c.token_ids, p, sequences)
        t = p.temperature if p.temperature > 0 else 1.0
        assert torch.equal(torch.tensor(c.logprobs), training_logprobs(model, out.prompt_token_ids, c.token_ids, t))
    assert any(NO in o.outputs[0].token_ids for o in outs)  # "no" alone stays samplable


@pytest.mark.parametrize("words", [["yes"], ["yes", "no way"]], ids=["one token", "two tokens: sampling after the host"])
def test_rows_do_not_depend_on_their_batch_the_cache_or_the_steps(folder, words):
    prompts = ["no", "say", "abc", "yes", "(a", "12", "x"]
    params = [_params(i, words if i % 2 == 0 else []) for i in range(7)]
    batch, alone, tight, replayed = tokens_four_ways(lambda **kw: _engine(folder, **kw), prompts, params, 12)
    assert batch == alone == tight == replayed


def test_steps_ahead_run_their_forward_first_and_sample_after_the_host(folder, monkeypatch):
    """With a bad word of two tokens the engine still launches steps ahead: their forwards go
    first, their sampling waits for the step before to be postprocessed (`LaunchedStep.waiting`:
    the bans need that step's tokens), and the tokens are the synchronous engine's."""
    prompts = ["no", "say", "abc", "yes", "(a"]
    params = [_params(i, ["yes", "no way"]) for i in range(5)]
    want = [o.outputs[0].token_ids for o in gen(_engine(folder, async_scheduling=False), prompts, params)]
    llm, waited = _engine(folder), count_waiting_samples(monkeypatch)
    assert [o.outputs[0].token_ids for o in gen(llm, prompts, params)] == want
    assert len(waited) >= 10  # (16 tokens a request: most steps went ahead)


def test_banned_matches_the_generated_tokens_only():
    words = BadWords([(7,), (3, 4), (5, 3, 4)])
    seq = Sequence(0, 0, [3], SamplingParams(), 1)  # the prompt's 3 does not count
    assert words.banned(seq) == [7]
    seq.token_ids += [3]
    assert words.banned(seq) == [7, 4]
    seq.token_ids += [5, 3]
    assert sorted(words.banned(seq)) == [4, 4, 7] and words.banned(seq, 3) == [7]
    assert words.needs_history and not BadWords([(2,), (1,), (2,)]).needs_history
    assert BadWords([(2,), (1,), (2,)]).single == [1, 2]


@pytest.mark.parametrize("value, match", [
    ("yes", r"bad_words='yes' must be a list of strings, got str"),
    (["yes", ""], r"bad_words\[1\]='' must be a string with a non-space character"),
    ([" "], r"bad_words\[0\]=' ' must be a string with a non-space character"),
    ([3], r"bad_words\[0\]=3 must be a string"),
])
def test_bad_values_are_refused(value, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(bad_words=value)
    assert SamplingParams(bad_words=None).bad_words == []


def test_bad_words_need_a_tokenizer_before_anything_runs(folder):
    llm = _engine(folder)
    bare = LLM(llm.model.causal_lm, device="cpu", block_size=4, kv_cache_bytes=1 << 20)
    with pytest.raises(ValueError, match=r"SamplingParams.bad_words needs a tokenizer"):
        gen(bare, [[3, 4], [5]], [SamplingParams(max_tokens=2), SamplingParams(bad_words=["yes"])])
    assert not bare.scheduler.has_unfinished()
