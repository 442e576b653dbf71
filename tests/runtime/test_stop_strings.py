"""Stop strings (``SamplingParams.stop``, `runtime.stop_strings`): a sample ends at the token whose
text completes a stop string, with the very tokens and logprobs of the same request without it
cut there; the text ends before the string (or after it, ``include_stop_str_in_output``);
``min_tokens`` holds them back; they need a tokenizer, which ``LLM(model, tokenizer=...)`` gives
a model instance."""

import pytest
import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers

import vexact_models.qwen3 as qwen3
from vexact_models.runtime import LLM, SamplingParams
from vexact_models.runtime.stop_strings import StopStrings, truncate_at_stop

from .llm_support import gen

ENGINE = dict(device="cpu", block_size=4, kv_cache_bytes=1 << 20, max_num_batched_tokens=32)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny Qwen3 folder with a word-level tokenizer (token i is the word ``w<i>``)."""
    path = tmp_path_factory.mktemp("stop_strings")
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(512)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0").save_pretrained(path)
    torch.manual_seed(1)
    transformers.Qwen3ForCausalLM(qwen3.tiny_config(initializer_range=0.5)).eval().save_pretrained(path)
    return path


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_a_stop_string_cuts_the_same_sample(checkpoint, temperature):
    llm = LLM(str(checkpoint), **ENGINE)
    free = SamplingParams(temperature=temperature, max_tokens=12, ignore_eos=True, seed=5)
    [full] = gen(llm, ["w1 w2 w3"], free)
    ids, lps = full.outputs[0].token_ids, full.outputs[0].logprobs
    words = full.outputs[0].text.split(" ")
    assert len(words) == 12
    # a string spanning the end of word 4 and the start of word 5: completed by token 5 (index 4)
    stop = f"{words[3][1:]} {words[4][:2]}"
    first = next(i for i in range(12) if stop in " ".join(words[:i + 1]))
    for include in (False, True):
        params = SamplingParams(temperature=temperature, max_tokens=12, ignore_eos=True, seed=5,
                                stop=["never there", stop], include_stop_str_in_output=include)
        [out] = gen(llm, ["w1 w2 w3"], params)
        c = out.outputs[0]
        assert (c.token_ids, c.logprobs) == (ids[:first + 1], lps[:first + 1])
        assert (c.finish_reason, c.stop_reason) == ("stop", stop)
        cut = full.outputs[0].text.index(stop)
        assert c.text == full.outputs[0].text[:cut + (len(stop) if include else 0)]


def test_min_tokens_holds_a_stop_string_back(checkpoint):
    llm = LLM(str(checkpoint), **ENGINE)
    [full] = gen(llm, ["w1 w2 w3"], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    first_word = full.outputs[0].text.split(" ")[0]
    held = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, stop=[first_word], min_tokens=3)
    [out] = gen(llm, ["w1 w2 w3"], held)
    c = out.outputs[0]
    assert len(c.token_ids) >= 4 and c.token_ids == full.outputs[0].token_ids[:len(c.token_ids)]
    assert (c.finish_reason, c.stop_reason) in (("length", None), ("stop", first_word))
    [now] = gen(llm, ["w1 w2 w3"], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, stop=first_word))
    assert len(now.outputs[0].token_ids) == 1 and now.outputs[0].text == ""


def test_a_stop_token_ends_the_sample_out_of_its_text_and_is_its_stop_reason(checkpoint):
    """As vLLM's: a sample ended by one of ``stop_token_ids`` reports that id as its ``stop_reason``
    (the model's own EOS: None) and its text leaves the token out, unless
    ``include_stop_str_in_output``; its tokens and logprobs keep it. Without CUDA graphs or
    tokens in flight, ``max_tokens=None`` runs to ``max_model_len``."""
    llm = LLM(str(checkpoint), **ENGINE, max_model_len=24)
    [full] = gen(llm, ["w1 w2 w3"], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    ids, words = full.outputs[0].token_ids, full.outputs[0].text.split(" ")
    stop = ids[2]
    for include in (False, True):
        [out] = gen(llm, ["w1 w2 w3"], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True,
                                                      stop_token_ids=[stop], include_stop_str_in_output=include))
        c = out.outputs[0]
        upto = ids.index(stop) + 1
        assert (c.token_ids, c.finish_reason, c.stop_reason) == (ids[:upto], "stop", stop)
        assert c.text == " ".join(words[:upto if include else upto - 1])
    llm.scheduler.eos_token_id = stop  # the model's own EOS: the same text, no stop_reason
    [out] = gen(llm, ["w1 w2 w3"], SamplingParams(temperature=0.0, max_tokens=8))
    assert (out.outputs[0].finish_reason, out.outputs[0].stop_reason) == ("stop", None)
    assert out.outputs[0].text == " ".join(words[:ids.index(stop)])
    [out] = gen(llm, ["w1 w2 w3"], SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 24 - 3 and out.outputs[0].finish_reason == "length"


def test_stop_strings_need_a_tokenizer_which_a_model_instance_can_be_given(checkpoint):
    model = qwen3.Qwen3ForCausalLM.from_pretrained(str(checkpoint)).eval()
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, stop=["w"])
    bare = LLM(model, device="cpu", block_size=4, kv_cache_bytes=1 << 20)
    with pytest.raises(ValueError, match=r"SamplingParams.stop \(stop strings\) needs a tokenizer"):
        gen(bare, [[1, 2, 3]], params)
    assert not bare.scheduler.has_unfinished()
    told = LLM(qwen3.Qwen3ForCausalLM.from_pretrained(str(checkpoint)).eval(), device="cpu", block_size=4,
               kv_cache_bytes=1 << 20, tokenizer=str(checkpoint))
    [out] = gen(told, ["w1 w2 w3"], params)
    assert out.outputs[0].stop_reason == "w" and len(out.outputs[0].token_ids) == 1
    with pytest.raises(ValueError, match=r"tokenizer='/no/such' could not be loaded"):
        LLM(model, device="cpu", tokenizer="/no/such")
    with pytest.raises(ValueError, match=r"tokenizer must be a transformers tokenizer .* got a int"):
        LLM(model, device="cpu", tokenizer=3)


def test_skip_special_tokens_and_detokenize_shape_the_text_as_vllms(checkpoint):
    """A special token is left out of the text by default and kept with
    ``skip_special_tokens=False``, where a stop string may then hold it; ``detokenize=False``
    returns no text. The tokens and logprobs are the same in every case."""
    from tokenizers import Tokenizer as RawTokenizer

    llm = LLM(str(checkpoint), **ENGINE)
    base = dict(temperature=0.0, max_tokens=6, ignore_eos=True)
    [plain] = gen(llm, ["w1 w2 w3"], SamplingParams(**base))
    special = f"w{plain.outputs[0].token_ids[1]}"  # the second sampled token becomes a special token
    raw = RawTokenizer.from_file(str(checkpoint / "tokenizer.json"))
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="w0",
                                                     additional_special_tokens=[special])
    llm = LLM(str(checkpoint), tokenizer=tokenizer, **ENGINE)
    words = plain.outputs[0].text.split(" ")
    [skipped] = gen(llm, ["w1 w2 w3"], SamplingParams(**base))
    [kept] = gen(llm, ["w1 w2 w3"], SamplingParams(**base, skip_special_tokens=False))
    assert special not in skipped.outputs[0].text.split(" ") and kept.outputs[0].text.split(" ") == words
    [stopped] = gen(llm, ["w1 w2 w3"], SamplingParams(**base, skip_special_tokens=False, stop=[special]))
    assert stopped.outputs[0].stop_reason == special and len(stopped.outputs[0].token_ids) == 2
    [no_text] = gen(llm, ["w1 w2 w3"], SamplingParams(**base, detokenize=False, logprobs=1))
    assert no_text.outputs[0].text is None and all(v.decoded_token is None for e in no_text.outputs[0].logprobs
                                                   for v in e.values())
    for out in (skipped, kept, no_text):
        c = out.outputs[0]
        assert c.token_ids == plain.outputs[0].token_ids and c.cumulative_logprob == plain.outputs[0].cumulative_logprob
    with pytest.raises(ValueError, match=r"stop=\['x'\] needs detokenize=True"):
        SamplingParams(stop="x", detokenize=False)
    for name in ("skip_special_tokens", "detokenize"):
        with pytest.raises(ValueError, match=f"SamplingParams.{name}=1 must be a bool"):
            SamplingParams(**{name: 1})


class JoinedSpecialTokenizer(transformers.PreTrainedTokenizerFast):
    """A tokenizer of one's own that honours ``spaces_between_special_tokens`` (transformers 5's
    accept and ignore it): False joins the words without spaces."""

    def _decode(self, token_ids, skip_special_tokens=False, spaces_between_special_tokens=True, **kwargs):
        text = super()._decode(token_ids, skip_special_tokens=skip_special_tokens, **kwargs)
        return text if spaces_between_special_tokens else text.replace(" ", "")


def test_spaces_between_special_tokens_reaches_the_tokenizer_for_text_and_stop_strings(checkpoint):
    """vLLM's field goes to the tokenizer's ``decode``: the text and the text stop strings are
    matched on are the tokenizer's with it; the tokens stay the same."""
    from tokenizers import Tokenizer as RawTokenizer

    raw = RawTokenizer.from_file(str(checkpoint / "tokenizer.json"))
    llm = LLM(str(checkpoint), tokenizer=JoinedSpecialTokenizer(tokenizer_object=raw, unk_token="w0"), **ENGINE)
    base = dict(temperature=0.0, max_tokens=6, ignore_eos=True)
    [spaced] = gen(llm, ["w1 w2 w3"], SamplingParams(**base))
    [joined] = gen(llm, ["w1 w2 w3"], SamplingParams(**base, spaces_between_special_tokens=False))
    words = spaced.outputs[0].text.split(" ")
    assert len(words) == 6 and joined.outputs[0].text == "".join(words)
    assert joined.outputs[0].token_ids == spaced.outputs[0].token_ids
    pair = "".join(words[2:4])  # only the joined text holds two words without a space
    [stopped] = gen(llm, ["w1 w2 w3"], SamplingParams(**base, spaces_between_special_tokens=False, stop=[pair]))
    assert stopped.outputs[0].stop_reason == pair and len(stopped.outputs[0].token_ids) == 4
    [not_stopped] = gen(llm, ["w1 w2 w3"], SamplingParams(**base, stop=[pair]))
    assert not_stopped.outputs[0].finish_reason == "length"


@pytest.mark.parametrize("stop, words", [(3, "a string or a list"), ([""], r"stop\[0\]='' must be a non-empty"),
                                         (["a", 4], r"stop\[1\]=4 must be")])
def test_bad_stop_strings_are_refused_naming_them(stop, words):
    with pytest.raises(ValueError, match=words):
        SamplingParams(stop=stop)
    assert SamplingParams(stop="x").stop == ["x"]
    with pytest.raises(ValueError, match="include_stop_str_in_output=1 must be a bool"):
        SamplingParams(include_stop_str_in_output=1)


class CharTokenizer:
    """Token i decodes to CHARS[i]; token 0 is a special token (skipped), token 1 half a
    character (the replacement character until token 2 completes it as an 'é')."""

    CHARS = {0: "", 3: "a", 4: "b", 5: "<", 6: "/", 7: ">"}

    def decode(self, ids, skip_special_tokens=True):
        text = []
        for i, t in enumerate(ids):
            if t == 1:
                text.append("é" if i + 1 < len(ids) and ids[i + 1] == 2 else "\ufffd")
            elif t != 2:
                text.append(self.CHARS[t])
        return "".join(text)


def test_a_match_is_found_once_at_the_token_that_completes_it():
    stops = StopStrings(CharTokenizer(), ["</", "éb"])
    prompt = [3, 5, 6]  # the prompt's own "</" never counts
    seq = prompt + [3, 5, 0, 6, 4]
    found = [stops.matched(seq[:n], len(prompt)) for n in range(len(prompt) + 1, len(seq) + 1)]
    assert found == [None, None, None, "</", None]  # the special token between adds no text
    seq = prompt + [1, 2, 4]
    assert [stops.matched(seq[:n], len(prompt)) for n in range(4, 7)] == [None, None, "éb"]
    assert truncate_at_stop(CharTokenizer(), [3, 5, 0, 6], "</", False) == "a"
    assert truncate_at_stop(CharTokenizer(), [3, 5, 0, 6], "</", True) == "a</"
