"""`LLM.chat` (`runtime.llm_chat`): conversations rendered by the tokenizer's chat template and
rolled out as their token ids (no second set of special tokens), as vLLM's ``LLM.chat``; bad
conversations and a missing tokenizer or template are refused before any work. And
``CompletionOutput.cumulative_logprob``."""

import math

import pytest
import transformers

import vexact_models.qwen3 as qwen3
from vexact_models.runtime import LLM, SamplingParams

from .llm_support import gen, result, save_chat_checkpoint

TEMPLATE = ("{{ bos_token }}{% for m in messages %}w{{ 10 if m['role'] == 'user' else 11 }} w{{ m['content'] }} "
            "{% endfor %}{% if think %}w12 {% endif %}{% if add_generation_prompt %}w11{% endif %}")
PARAMS = SamplingParams(temperature=0.9, max_tokens=5, ignore_eos=True, seed=3)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny Qwen3 with a word-level tokenizer (``w<i>`` is token i, w2 its BOS) and a chat template."""
    return save_chat_checkpoint(tmp_path_factory.mktemp("chat"), TEMPLATE)


def test_chat_rolls_out_the_rendered_conversation(folder):
    llm = LLM(str(folder), device="cpu", block_size=4, kv_cache_bytes=1 << 20)
    one = [{"role": "user", "content": "5"}, {"role": "assistant", "content": "6"}, {"role": "user", "content": "7"}]
    other = [{"role": "user", "content": "8"}]
    [single] = llm.chat(one, PARAMS, use_tqdm=False)
    assert single.prompt == "w2w10 w5 w11 w6 w10 w7 w11"
    assert single.prompt_token_ids == [2, 10, 5, 11, 6, 10, 7, 11]  # one BOS: the template's
    assert result(single) == result(gen(llm, [[2, 10, 5, 11, 6, 10, 7, 11]], PARAMS)[0])
    both = llm.chat([one, other], PARAMS, use_tqdm=False, chat_template_kwargs={"think": True})
    assert [o.prompt_token_ids for o in both] == [[2, 10, 5, 11, 6, 10, 7, 12, 11], [2, 10, 8, 12, 11]]
    c = both[1].outputs[0]
    assert c.cumulative_logprob == math.fsum(c.logprobs) and c.cumulative_logprob < 0


def test_chat_refuses_bad_conversations_and_a_missing_tokenizer(folder):
    llm = LLM(str(folder), device="cpu", block_size=4, kv_cache_bytes=1 << 20)
    for bad, words in [([[]], "conversation 0 must be a non-empty list"),
                       ([[{"role": "user", "content": "5"}], [{"content": "6"}]], "message 0 of conversation 1"),
                       (["hello"], "conversation 0 must be a non-empty list")]:
        with pytest.raises(ValueError, match=words):
            llm.chat(bad, PARAMS)
    assert not llm.scheduler.has_unfinished()
    bare = LLM(qwen3.Qwen3ForCausalLM.from_pretrained(str(folder)).eval(), device="cpu", block_size=4,
               kv_cache_bytes=1 << 20)
    with pytest.raises(ValueError, match="LLM.chat needs a tokenizer"):
        bare.chat([{"role": "user", "content": "5"}], PARAMS)
    plain = transformers.AutoTokenizer.from_pretrained(str(folder))
    plain.chat_template = None
    untemplated = LLM(str(folder), device="cpu", block_size=4, kv_cache_bytes=1 << 20, tokenizer=plain)
    with pytest.raises(ValueError, match="chat_template"):
        untemplated.chat([{"role": "user", "content": "5"}], PARAMS)


def test_get_and_set_tokenizer_as_vllms(folder):
    """``get_tokenizer`` returns the engine's; ``set_tokenizer`` takes a tokenizer or a folder,
    and text prompts and chat use it from then on; a bad one is refused, the old one kept."""
    bare = LLM(qwen3.Qwen3ForCausalLM.from_pretrained(str(folder)).eval(), device="cpu", block_size=4,
               kv_cache_bytes=1 << 20)
    assert bare.get_tokenizer() is None
    bare.set_tokenizer(str(folder))
    tokenizer = bare.get_tokenizer()
    assert tokenizer("w5 w6")["input_ids"] == [5, 6]
    [out] = gen(bare, ["w5 w6"], PARAMS)
    assert out.prompt_token_ids == [5, 6] and out.outputs[0].text
    for bad, words in [(None, "got None"), (3, "got a int"), ("/no/such", "could not be loaded")]:
        with pytest.raises(ValueError, match=words):
            bare.set_tokenizer(bad)
        assert bare.get_tokenizer() is tokenizer
