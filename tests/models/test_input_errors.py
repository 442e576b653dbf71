"""Config and input values HF code would take silently or fail on obscurely: `head_dim_of`
(head_dim 0 used to become hidden/heads) and packed ``cu_seqlens`` (decreasing offsets used to
fail inside ``repeat_interleave``)."""

from types import SimpleNamespace

import pytest
import torch
import transformers

import vexact_models.qwen3 as qwen3
from vexact_models.flat_batch import flatten_inputs
from vexact_models.layers import head_dim_of


@pytest.mark.parametrize("head_dim, words", [
    (0, ["head_dim=0", "even int >= 2"]),
    (-16, ["head_dim=-16", "even int >= 2"]),
    (15, ["head_dim=15", "even int >= 2"]),
])
def test_bad_head_dim_is_rejected_by_the_model(head_dim, words):
    config = qwen3.tiny_config()
    config.head_dim = head_dim  # set after construction: newer configs validate some of these themselves
    with pytest.raises(ValueError) as info:
        qwen3.Qwen3ForCausalLM(config)
    for word in ["Qwen3Config"] + words:
        assert word in str(info.value), (word, str(info.value))


def test_head_dim_from_hidden_size_must_divide():
    # plain namespaces: newer transformers configs refuse head_dim=None or a float on assignment
    config = SimpleNamespace(hidden_size=64, num_attention_heads=4, head_dim=None)
    assert head_dim_of(config) == 16
    with pytest.raises(ValueError, match="head_dim=16.0 must be an even int"):
        head_dim_of(SimpleNamespace(hidden_size=64, num_attention_heads=4, head_dim=16.0))
    with pytest.raises(ValueError, match="hidden_size=66 must be a multiple of num_attention_heads=4"):
        head_dim_of(SimpleNamespace(hidden_size=66, num_attention_heads=4))
    with pytest.raises(ValueError, match="num_attention_heads=0 must be an int >= 1"):
        head_dim_of(SimpleNamespace(hidden_size=64, num_attention_heads=0))


@pytest.mark.parametrize("cu, words", [
    ([0, 5, 3, 10], ["non-decreasing", "cu_seqlens[2]=3 is below cu_seqlens[1]=5"]),
    ([0, 12, 10], ["non-decreasing", "cu_seqlens[2]=10 is below cu_seqlens[1]=12"]),
    ([0, 4, 9], ["from 0 to the 10 tokens", "[0, 4, 9]"]),
    ([1, 4, 10], ["from 0 to the 10 tokens"]),
    ([10], ["at least 2 offsets"]),
    (torch.tensor([0.0, 4.0, 10.0]), ["integer", "torch.float32"]),
    (torch.tensor([[0, 4, 10]]), ["1-D", "(1, 3)"]),
])
def test_bad_cu_seqlens_name_the_offsets(cu, words):
    ids = torch.arange(10)
    with pytest.raises(ValueError) as info:
        flatten_inputs(ids, cu_seqlens=cu if isinstance(cu, torch.Tensor) else torch.tensor(cu))
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_empty_packed_sequences_are_allowed_and_change_nothing():
    torch.manual_seed(0)
    model = qwen3.Qwen3ForCausalLM(qwen3.tiny_config(initializer_range=0.5)).eval()
    ids = torch.randint(2, 512, (10,))
    with torch.no_grad():
        plain = model.token_logprobs(ids, cu_seqlens=torch.tensor([0, 4, 10]))
        with_empty = model.token_logprobs(ids, cu_seqlens=torch.tensor([0, 0, 4, 4, 10, 10], dtype=torch.int32))
    assert torch.equal(plain, with_empty)


def test_a_kv_cache_holding_tokens_is_refused_and_an_empty_one_ignored():
    """`forward_arguments.refuse_kv_prefix`: a ``past_key_values`` (or transformers 5.25's
    ``cache``) holding tokens, as a transformers ``Cache`` or the legacy per-layer tuple, is a
    ValueError naming the argument and the count, in the causal LM and the base model (the heads
    build on it); an empty ``DynamicCache``, None and ``use_cache`` change nothing."""
    from transformers import DynamicCache

    from vexact_models.forward_arguments import cached_tokens

    model = qwen3.Qwen3ForCausalLM(qwen3.tiny_config()).eval()
    ids = torch.tensor([[3, 4, 5]])
    heads, dim = model.config.num_key_value_heads, model.config.head_dim
    legacy = tuple((torch.zeros(1, heads, 2, dim), torch.zeros(1, heads, 2, dim))
                   for _ in range(model.config.num_hidden_layers))
    filled = DynamicCache()
    filled.update(*legacy[0], layer_idx=0)
    assert [cached_tokens(c) for c in (None, (), DynamicCache(), legacy, filled)] == [0, 0, 0, 2, 2]
    with torch.no_grad():
        plain = model(ids).logits
        for name in ("past_key_values", "cache"):
            for cache in (legacy, filled):
                for forward in (model, model.model):
                    with pytest.raises(ValueError, match=f"{name} holds 2 cached tokens, a prefix"):
                        forward(ids, **{name: cache})
            assert torch.equal(model(ids, use_cache=True, **{name: DynamicCache()}).logits, plain)
            assert torch.equal(model(ids, **{name: None}).logits, plain)


def test_a_cache_a_forward_left_empty_is_refused_when_it_comes_back(monkeypatch):
    """`forward_arguments.unfilled_cache`: the training forward keeps no KV cache, so a cache it
    is given comes back as its ``past_key_values`` still empty, and so does a new one for an
    explicit ``use_cache=True``; given again (a cached decode loop's next step, fed only the new
    tokens), either is a ValueError naming the argument and the earlier forward, in the causal
    LM and the base model, instead of logits computed without the prompt. ``use_cache`` from the
    config (on by default, as stock reads it) returns one too, so that a manual loop that leaves it
    to the config fails the same way, and the tuple output matches stock's layout. The cache goes in the
    output field of the installed release's name (``cache`` from 5.25 on), so transformers logs
    no deprecation warning."""
    from transformers import DynamicCache
    from transformers.utils import generic

    said = []
    monkeypatch.setattr(generic.logger, "warning_once", lambda message, *a, **k: said.append(message))
    model = qwen3.Qwen3ForCausalLM(qwen3.tiny_config()).eval()
    ids = torch.randint(2, 512, (1, 9))
    with torch.no_grad():
        prompt = model(ids[:, :7]).logits
        for name in ("past_key_values", "cache"):
            for forward in (model, model.model):
                given = DynamicCache()
                out = forward(ids[:, :7], use_cache=True, **{name: given})
                made = forward(ids[:, :7], use_cache=True)[-1]
                assert out[-1] is given and isinstance(made, DynamicCache)
                assert given.get_seq_length() == made.get_seq_length() == 0
                for cache in (given, made):
                    with pytest.raises(ValueError, match=f"{name} is a cache that an earlier forward of 7 tokens "
                                                         "left empty"):
                        forward(ids[:, 7:], **{name: cache})
            assert torch.equal(model(ids[:, :7], **{name: DynamicCache()}).logits, prompt)
        stock = transformers.Qwen3ForCausalLM(model.config).eval()
        for kwargs in ({}, {"use_cache": False}, {"return_dict": False}, {"use_cache": False, "return_dict": False},
                       {"output_hidden_states": True, "return_dict": False}):
            ours, theirs = model(ids, **kwargs), stock(ids, **kwargs)
            assert len(ours) == len(theirs) and [type(v) for v in ours.values()] == [type(v) for v in theirs.values()] \
                if isinstance(ours, dict) else [type(v) for v in ours] == [type(v) for v in theirs], kwargs
        assert len(model.model(ids)) == len(stock.model(ids)) == 2
        loop = model(ids[:, :7])[-1]  # a manual loop that leaves use_cache to the config
        with pytest.raises(ValueError, match="left empty"):
            model(ids[:, 7:], cache=loop)
    assert not [message for message in said if "deprecated" in message], said
