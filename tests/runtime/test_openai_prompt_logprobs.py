"""The prompt's own logprobs through the OpenAI-compatible server (`runtime.openai_protocol`): a
completion's ``echo`` (with ``max_tokens: 0``, as lm-evaluation-harness scores a text) and vLLM's
``prompt_logprobs``, on completions (streamed or not) and chat, each float bitwise the one
``LLM.generate(prompt_logprobs=k)`` gives (the training forward's)."""

import pytest

from vexact_models.runtime import LLM, SamplingParams
from vexact_models.runtime.openai_server import OpenAIServer

from .llm_support import save_chat_checkpoint

openai = pytest.importorskip("openai")  # (the main test environment has it; the older-transformers runs do not)

TEMPLATE = "{{ bos_token }}{% for m in messages %}w{{ 10 if m['role'] == 'user' else 11 }} w{{ m['content'] }} {% endfor %}w11"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny Qwen3 with a word-level tokenizer (``w<i>`` is token i, w2 its BOS) and a chat template."""
    return save_chat_checkpoint(tmp_path_factory.mktemp("echo"), TEMPLATE)


@pytest.fixture(scope="module")
def client(folder):
    llm = LLM(str(folder), device="cpu", block_size=4, kv_cache_bytes=1 << 20, max_num_seqs=8, max_num_batched_tokens=32)
    server = OpenAIServer(llm, "tiny", port=0).start()
    yield openai.OpenAI(base_url=server.url, api_key="none", max_retries=0)
    server.close()


@pytest.fixture(scope="module")
def reference(folder):
    return LLM(str(folder), device="cpu", block_size=4, kv_cache_bytes=1 << 20)


def _prompt_scores(reference, prompt, k: int, temperature: float = 1.0):
    """``generate``'s output with the prompt logprobs of `prompt` (k alternatives a position, at
    `temperature`, the engine's logprob temperature), and their floats."""
    out = reference.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=k, temperature=temperature),
                             use_tqdm=False)[0]
    return out, [e[t].logprob for t, e in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:])]


def test_echo_without_tokens_scores_the_prompt(client, reference):
    """lm-evaluation-harness's loglikelihood request: the prompt back as the text, its tokens'
    logprobs (None first) with their most probable alternative, nothing generated."""
    prompt = "w5 w6 w7 w8 w9 w30"
    reply = client.completions.create(model="tiny", prompt=prompt, max_tokens=0, echo=True, logprobs=1, temperature=0)
    choice = reply.choices[0]
    out, floats = _prompt_scores(reference, prompt, 1)
    assert choice.text == prompt and choice.finish_reason == "length"
    assert choice.logprobs.tokens == prompt.split()
    assert choice.logprobs.token_logprobs == [None] + floats  # bitwise
    assert choice.logprobs.top_logprobs[0] is None
    for token, top, entries in zip(choice.logprobs.tokens[1:], choice.logprobs.top_logprobs[1:], out.prompt_logprobs[1:]):
        best = min(entries.values(), key=lambda e: e.rank)
        assert top[token] in floats and top[best.decoded_token] == best.logprob and len(top) in (1, 2)
    assert choice.logprobs.text_offset == [0, 2, 4, 6, 8, 10]  # (each token's text: no spaces at this tokenizer)
    assert reply.usage.prompt_tokens == 6 and reply.usage.completion_tokens == 0


def test_echo_with_tokens_streamed_or_not(client, reference):
    """Token-id prompts echo as their text; the reply follows; a stream's first chunk carries the
    prompt and the chunks add up to the whole."""
    prompt = [5, 9, 40, 7]
    kwargs = dict(model="tiny", prompt=prompt, max_tokens=4, echo=True, logprobs=0, seed=3, temperature=0.9,
                  extra_body={"ignore_eos": True})
    whole = client.completions.create(**kwargs).choices[0]
    want = reference.generate([{"prompt_token_ids": prompt}], SamplingParams(
        max_tokens=4, seed=3, temperature=0.9, ignore_eos=True, prompt_logprobs=0), use_tqdm=False)[0]
    assert whole.text == "w5 w9 w40 w7" + want.outputs[0].text
    _, floats = _prompt_scores(reference, {"prompt_token_ids": prompt}, 0, 0.9)
    assert whole.logprobs.token_logprobs == [None] + floats + want.outputs[0].logprobs
    chunks = list(client.completions.create(**kwargs, stream=True))
    assert chunks[0].choices[0].text.startswith("w5 w9 w40 w7")
    assert "".join(c.choices[0].text for c in chunks) == whole.text
    assert sum((c.choices[0].logprobs.token_logprobs for c in chunks), []) == whole.logprobs.token_logprobs
    assert sum((c.choices[0].logprobs.text_offset for c in chunks), []) == whole.logprobs.text_offset


def test_every_sample_echoes_the_prompt_streamed_or_not(client):
    kwargs = dict(model="tiny", prompt="w5 w6 w7", max_tokens=3, n=3, echo=True, logprobs=0, seed=8, temperature=1.0,
                  extra_body={"ignore_eos": True})
    whole = {c.index: c for c in client.completions.create(**kwargs).choices}
    texts, logprobs = {}, {}
    for chunk in client.completions.create(**kwargs, stream=True):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            logprobs[c.index] = logprobs.get(c.index, []) + c.logprobs.token_logprobs
    assert sorted(texts) == [0, 1, 2]
    for index, choice in whole.items():
        assert choice.text.startswith("w5 w6 w7") and texts[index] == choice.text
        assert logprobs[index] == choice.logprobs.token_logprobs and len(logprobs[index]) == 6


def test_prompt_logprobs_field_on_completions_and_chat(client, reference):
    prompt = "w5 w6 w7 w8"
    reply = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, extra_body={"prompt_logprobs": 2})
    out, _ = _prompt_scores(reference, prompt, 2)
    want = [None] + [{str(t): {"logprob": e.logprob, "rank": e.rank, "decoded_token": e.decoded_token}
                      for t, e in entries.items()} for entries in out.prompt_logprobs[1:]]
    assert reply.choices[0].model_extra["prompt_logprobs"] == want
    assert reply.choices[0].text.count("w") == 2  # the reply itself, not echoed
    chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=3, stream=True,
                                            extra_body={"prompt_logprobs": 2, "ignore_eos": True}))
    assert chunks[0].choices[0].model_extra["prompt_logprobs"] == want
    assert all("prompt_logprobs" not in c.choices[0].model_extra for c in chunks[1:])
    messages = [{"role": "user", "content": "5"}]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=2,
                                          extra_body={"prompt_logprobs": 1, "return_token_ids": True})
    ids = chat.choices[0].model_extra["prompt_token_ids"]
    out, floats = _prompt_scores(reference, {"prompt_token_ids": ids}, 1)
    assert [None if e is None else e[str(t)]["logprob"] for t, e in zip(ids, chat.model_extra["prompt_logprobs"])] == \
        [None] + floats
