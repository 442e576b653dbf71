"""What a training stack expects of an HF causal LM, for every registered architecture at every
shape: hidden states, tuple outputs, inputs_embeds, positions past max_position_embeddings,
generate(), generation_config, reward/critic heads (docs/design.md section 8, drop-in)."""

import inspect

import pytest
import torch
from transformers import (AutoModelForCausalLM, AutoModelForSequenceClassification, AutoModelForTokenClassification,
                          GenerationConfig)

import vexact_models
from vexact_models.runtime import LLM

from ..runtime.llm_support import gen, make_llm
from .model_support import SHAPES, rel, shape_id, skip_unless_stock_has, stock_model

pytestmark = pytest.mark.compat


@pytest.fixture(scope="module", params=SHAPES, ids=shape_id)
def pair(request, tmp_path_factory):
    """(architecture, stock HF model, our model loaded from the stock checkpoint, its path)."""
    arch, shape = request.param
    path = tmp_path_factory.mktemp(shape_id(request.param).replace(":", "-"))
    hf = stock_model(arch, shape=shape)
    hf.save_pretrained(path)
    ours = arch.causal_lm_class.from_pretrained(path, dtype=torch.float32).eval()
    return arch, hf, ours, path


def left_padded(batch: int = 3, length: int = 19):
    ids = torch.randint(2, 512, (batch, length))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    mask[2, :11] = 0
    return ids, mask


def test_hidden_states_match_stock(pair):
    _, hf, ours, _ = pair
    ids, mask = left_padded()
    with torch.no_grad():
        a = ours(ids, attention_mask=mask, output_hidden_states=True).hidden_states
        b = hf(ids, attention_mask=mask, output_hidden_states=True).hidden_states
    assert len(a) == len(b) == ours.config.num_hidden_layers + 1
    keep = mask.bool()
    for mine, stock in zip(a, b):
        assert rel(mine[keep], stock[keep]) <= 1e-5
    base = ours.model(ids, attention_mask=mask, output_hidden_states=True)
    assert torch.equal(base.hidden_states[-1], base.last_hidden_state)
    assert ours(ids).hidden_states is None


@pytest.mark.parametrize("checkpointing", [None, {"use_reentrant": False}, {"use_reentrant": True}],
                         ids=["plain", "checkpointed", "reentrant"])
def test_hidden_states_are_on_the_gradient_path_as_stock(pair, checkpointing):
    """Stock's hidden states are tensors the rest of the forward reads, so a loss on the logits
    reaches each (``retain_grad``, ``autograd.grad``); ours are padded copies put on that path
    (`vexact_models.hidden_states`). Their gradients match stock's within parity, and the
    weights' gradients are bitwise those of the same forward without hidden states, under
    activation checkpointing too."""
    _, hf, ours, _ = pair
    ids, mask = left_padded()
    keep = mask.bool()
    scale = torch.randn(ours.config.vocab_size, generator=torch.Generator().manual_seed(0))
    params = [p for p in ours.parameters() if p.requires_grad]

    def run(model, hidden: bool):
        out = model(ids, attention_mask=mask, output_hidden_states=hidden)
        loss = (out.logits[keep] * scale).sum()
        states = out.hidden_states if hidden else ()
        return torch.autograd.grad(loss, [*states, *(params if model is ours else [])], allow_unused=True)

    ours.train()
    if checkpointing is not None:
        ours.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpointing)
    try:
        plain = run(ours, hidden=False)
        with_states = run(ours, hidden=True)
    finally:
        ours.gradient_checkpointing_disable()
        ours.eval()
    count = ours.config.num_hidden_layers + 1
    mine, weights = with_states[:count], with_states[count:]
    assert all(g is not None for g in mine), [i for i, g in enumerate(mine) if g is None]
    assert all(a is b or torch.equal(a, b) for a, b in zip(weights, plain))  # both None for an unused one
    stock = run(hf, hidden=True)
    for i, (got, want) in enumerate(zip(mine, stock)):
        assert rel(got[keep], want[keep]) <= 1e-4, i


def test_logits_to_keep_keeps_the_positions_stock_keeps(pair):
    """HF's ``logits_to_keep`` (TRL passes it): the last K positions (an int) or the positions a
    1-D tensor lists, the head run on those tokens only. Bitwise the full forward's logits there,
    within parity of stock's, and a tensor of its own, not a view (test_module_outputs.py)."""
    _, hf, ours, _ = pair
    ids, mask = left_padded()
    listed = [0, -1, 12, 12]
    with torch.no_grad():
        full = ours(ids, attention_mask=mask).logits
        for keep, where in ((1, slice(-1, None)), (7, slice(-7, None)), (0, slice(None)), (40, slice(None)),
                            (torch.tensor(listed), listed)):
            got = ours(ids, attention_mask=mask, logits_to_keep=keep).logits
            stock = hf(ids, attention_mask=mask, logits_to_keep=keep).logits
            assert got.shape == stock.shape and torch.equal(got, full[:, where]) and got._base is None, keep
            live = mask[:, where].bool()
            assert rel(got[live], stock[live]) <= 1e-5
        for bad, message in ((-1, "logits_to_keep=-1 must be an int >= 0"), (2.0, "logits_to_keep=2.0 must be"),
                             (torch.tensor([[1]]), "1-D integer tensor"), (torch.tensor([19]), r"outside \[-19, 19\)")):
            with pytest.raises(ValueError, match=message):
                ours(ids, attention_mask=mask, logits_to_keep=bad)


def test_return_dict_false_gives_a_tuple(pair):
    _, _, ours, _ = pair
    ids = torch.randint(0, 512, (2, 9))
    with torch.no_grad():
        full = ours(ids, labels=ids)
        out = ours(ids, labels=ids, return_dict=False)
        base = ours.model(ids, return_dict=False)
    assert isinstance(out, tuple) and torch.equal(out[0], full.loss) and torch.equal(out[1], full.logits)
    assert isinstance(base, tuple) and torch.equal(base[0], ours.model(ids).last_hidden_state)


def test_inputs_embeds_give_the_same_numbers_as_ids(pair):
    """And the forwards list ``inputs_embeds`` in their signatures, as stock's do: code that reads
    the signature (transformers' own model tests, trainers pruning dataset columns) finds it."""
    _, _, ours, _ = pair
    for forward in (ours.forward, ours.model.forward):
        assert "inputs_embeds" in inspect.signature(forward).parameters
    ids, mask = left_padded()
    with torch.no_grad():
        embeds = ours.get_input_embeddings()(ids)
        assert torch.equal(ours(inputs_embeds=embeds, attention_mask=mask).logits,
                           ours(ids, attention_mask=mask).logits)
        assert torch.equal(ours.model(inputs_embeds=embeds).last_hidden_state, ours.model(ids).last_hidden_state)
    with pytest.raises(ValueError, match="exactly one of input_ids and inputs_embeds"):
        ours(ids, inputs_embeds=embeds)
    with pytest.raises(ValueError, match="inputs_embeds must be"):
        ours(inputs_embeds=embeds[..., :7])


@pytest.mark.parametrize("case", SHAPES, ids=shape_id)
def test_positions_past_max_position_embeddings_match_stock(case):
    """Every shape: the RoPE variants differ (default, YaRN, llama3 scaling)."""
    arch, shape = case
    hf = stock_model(arch, shape=shape, max_position_embeddings=32)
    ours = arch.causal_lm_class(hf.config).eval()
    ours.load_state_dict(hf.state_dict())
    ids = torch.randint(0, 512, (1, 80))
    with torch.no_grad():
        short = ours(ids[:, :30]).logits
        long = ours(ids).logits
        assert rel(long, hf(ids).logits) <= 1e-5
    assert torch.equal(long[:, :30], short)  # growing the tables left the first rows as they were
    assert ours.model.rope.max_positions >= 80


def test_generate_greedy_equals_llm_greedy_and_stock(pair):
    arch, hf, ours, _ = pair
    from vexact_models.runtime import SamplingParams

    prompts = [[5, 9, 33, 2, 17], [44, 3, 8]]
    ids = torch.tensor([prompts[0], [0, 0] + prompts[1]])
    mask = torch.tensor([[1] * 5, [0, 0, 1, 1, 1]])
    out = ours.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, eos_token_id=None,
                        pad_token_id=0)
    assert out.shape == (2, 13) and torch.equal(out[:, :5], ids)
    engine = gen(make_llm(ours), prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    for row, request in zip(out, engine):
        assert row[5:].tolist() == request.outputs[0].token_ids
    stock = hf.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(out, stock), arch.name
    sampled = ours.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=True, temperature=0.8, top_k=20,
                            top_p=0.9, pad_token_id=0)
    assert sampled.shape[0] == 2 and torch.equal(sampled[:, :5], ids)


def test_the_first_generate_of_a_process_says_where_fast_rollouts_are(pair, monkeypatch, caplog):
    """`generation.tell_once_about_rollouts`: one warning on the ``vexact_models`` logger naming
    the class and `LLM`, at the first ``generate`` and not again."""
    from vexact_models import generation

    _, _, ours, _ = pair
    monkeypatch.setattr(generation, "_told_about_rollouts", False)
    ids = torch.tensor([[5, 9, 33]])
    with caplog.at_level("WARNING", logger="vexact_models"):
        for _ in range(2):
            ours.generate(ids, max_new_tokens=2, do_sample=False, eos_token_id=None, pad_token_id=0)
    said = [r.getMessage() for r in caplog.records if "one eager forward" in r.getMessage()]
    assert len(said) == 1 and type(ours).__name__ in said[0] and "vexact_models.LLM" in said[0], said


def _counting_tokens(model, monkeypatch) -> list[int]:
    """The token count of each forward of `model`'s decoder stack from now on."""
    counts, forward_flat = [], model.model.forward_flat

    def counted(input_ids, *args, **kwargs):
        counts.append(len(input_ids))
        return forward_flat(input_ids, *args, **kwargs)

    monkeypatch.setattr(model.model, "forward_flat", counted)
    return counts


def test_generate_steps_run_only_their_new_tokens_with_the_whole_recomputes_bits(pair, monkeypatch):
    """``generate`` keeps a KV cache of its own (`runtime.generate_cache`): the prompts' real
    tokens, then one token per row each step, go through the decoder; the logits of every step
    and the tokens (greedy, and sampled under one seed) are bitwise those of ``use_cache=False``,
    which recomputes the whole sequence each step."""
    _, _, ours, _ = pair
    ids, mask = left_padded(batch=3, length=9)
    mask[1, :3], mask[2, :6] = 0, 0
    mask[1, 3:], mask[2, 6:] = 1, 1
    counts = _counting_tokens(ours, monkeypatch)
    kwargs = dict(attention_mask=mask, max_new_tokens=6, eos_token_id=None, pad_token_id=0, output_logits=True,
                  return_dict_in_generate=True)
    cached = ours.generate(ids, do_sample=False, **kwargs)
    assert counts == [int(mask.sum())] + [3] * 5
    counts.clear()
    whole = ours.generate(ids, do_sample=False, use_cache=False, **kwargs)
    assert counts == [int(mask.sum()) + 3 * step for step in range(6)]
    assert torch.equal(cached.sequences, whole.sequences)
    assert all(torch.equal(a, b) for a, b in zip(cached.logits, whole.logits, strict=True))
    sampled = []
    for use_cache in (True, False):
        torch.manual_seed(11)
        sampled.append(ours.generate(ids, do_sample=True, temperature=0.9, use_cache=use_cache, **kwargs).sequences)
    assert torch.equal(*sampled)


def test_generate_from_several_threads_keeps_a_cache_per_thread(pair):
    """Two ``generate`` calls on one model in two threads at once (their forwards interleave)
    give the tokens and logits each gives alone: each thread's steps run over its own cache."""
    import threading

    _, _, ours, _ = pair
    prompts = [torch.tensor([[5, 9, 33, 2, 17]]), torch.tensor([[44, 3, 8], [7, 7, 1]])]
    kwargs = dict(max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0, output_logits=True,
                  return_dict_in_generate=True)
    alone = [ours.generate(ids, **kwargs) for ids in prompts]
    together = [None, None]

    def run(i):
        together[i] = ours.generate(prompts[i], **kwargs)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for a, b in zip(alone, together, strict=True):
        assert torch.equal(a.sequences, b.sequences) and all(map(torch.equal, a.logits, b.logits))


def test_generate_recomputes_each_step_for_beams_and_hidden_states(pair, monkeypatch):
    """A beam search (its steps reorder the rows) and ``output_hidden_states`` (every step's
    states cover the whole sequence, as stock's without a cache) run the whole recompute each
    step: the same output as ``use_cache=False``."""
    _, _, ours, _ = pair
    ids = torch.tensor([[5, 9, 33, 2, 17], [44, 3, 8, 21, 6]])
    counts = _counting_tokens(ours, monkeypatch)
    kwargs = dict(max_new_tokens=3, do_sample=False, eos_token_id=None, pad_token_id=0)
    beams = [ours.generate(ids, num_beams=2, use_cache=use_cache, **kwargs) for use_cache in (True, False)]
    assert torch.equal(*beams) and counts == [20, 24, 28] * 2
    counts.clear()
    states = ours.generate(ids, output_hidden_states=True, return_dict_in_generate=True, **kwargs)
    assert counts == [10, 12, 14] and states.hidden_states[-1][0].shape[1] == 7
    assert torch.equal(states.sequences, ours.generate(ids, **kwargs))


def test_generate_takes_a_generation_config_without_hf_deprecation_warning(pair, monkeypatch):
    """generate() turns the cache off in a copy of a given ``generation_config`` (keyword or
    positional), not as a loose ``use_cache`` beside it, which HF warns is deprecated: the same
    tokens as the loose arguments, the caller's config unchanged."""
    from transformers.generation import utils as generation_utils

    _, _, ours, _ = pair
    said = []
    monkeypatch.setattr(generation_utils.logger, "warning_once", lambda message, *a, **k: said.append(message))
    ids = torch.tensor([[5, 9, 33, 2, 17]])
    config = GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
    before = config.to_dict()
    loose = ours.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(ours.generate(ids, generation_config=config), loose)
    assert torch.equal(ours.generate(ids, config), loose)
    assert config.to_dict() == before
    assert not [message for message in said if "generation_config" in message], said


def test_generate_with_a_cache_generates_as_without_and_marks_it_left_empty(pair):
    """A cache given to generate() stays out of its cacheless steps: the same tokens as without
    one; it is marked as left empty, so a forward it is given to later refuses it
    (`forward_arguments.refuse_kv_prefix`) rather than running without the tokens generated."""
    from transformers import DynamicCache

    _, _, ours, _ = pair
    ids = torch.tensor([[5, 9, 33, 2, 17]])
    plain = ours.generate(ids, max_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=0)
    for name in ("past_key_values", "cache"):
        cache = DynamicCache()
        out = ours.generate(ids, max_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=0,
                            **{name: cache})
        assert torch.equal(out, plain) and cache.get_seq_length() == 0
        with pytest.raises(ValueError, match=f"{name} is a cache that generate left empty"):
            ours(out[:, -1:], **{name: cache})


@pytest.mark.parametrize("asks", ["assistant_model", "prompt_lookup_num_tokens", "generation_config", "model config"])
def test_generate_refuses_assisted_decoding_naming_the_argument(pair, asks):
    """Assisted decoding checks its candidates against the main model's KV cache, which the
    training variant does not keep: a ValueError naming what asked for it, before any step
    (HF's own loop raised a RuntimeError after the prompt's forward)."""
    _, _, ours, _ = pair
    ids = torch.tensor([[5, 9, 33, 2, 17]])
    kwargs, name = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": 0}, "prompt_lookup_num_tokens=2"
    saved = ours.generation_config
    if asks == "assistant_model":
        kwargs["assistant_model"], name = ours, f"assistant_model={type(ours).__name__}"
    elif asks == "prompt_lookup_num_tokens":
        kwargs["prompt_lookup_num_tokens"] = 2
    elif asks == "generation_config":
        kwargs = {"generation_config": GenerationConfig(max_new_tokens=4, prompt_lookup_num_tokens=2)}
    else:
        ours.generation_config = GenerationConfig(prompt_lookup_num_tokens=2)
    try:
        with pytest.raises(ValueError, match=f"generate: {name} asks for assisted decoding"):
            ours.generate(ids, **kwargs)
    finally:
        ours.generation_config = saved


def test_generation_config_eos_reaches_llm(pair):
    arch, _, _, path = pair
    GenerationConfig(eos_token_id=[3, 7], bos_token_id=0).save_pretrained(path)
    vexact_models.patch()
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    finally:
        vexact_models.unpatch()
    assert type(model) is arch.causal_lm_class and model.generation_config.eos_token_id == [3, 7]
    assert make_llm(model).eos_token_ids == [3, 7]
    assert LLM(path, device="cpu", kv_cache_bytes=1 << 24).eos_token_ids == [3, 7]  # (256 sequences of GDN states)


@pytest.mark.parametrize("head, auto", [("ForSequenceClassification", AutoModelForSequenceClassification),
                                        ("ForTokenClassification", AutoModelForTokenClassification)])
@pytest.mark.parametrize("case", SHAPES, ids=shape_id)
def test_reward_and_critic_heads_load_stock_checkpoints(case, head, auto, tmp_path):
    arch, shape = case
    skip_unless_stock_has(arch, head)
    hf = stock_model(arch, head, shape=shape, num_labels=1, pad_token_id=0)
    hf.save_pretrained(tmp_path)
    vexact_models.patch()
    try:
        ours = auto.from_pretrained(tmp_path, dtype=torch.float32).eval()
        from_config = auto.from_config(hf.config)
    finally:
        vexact_models.unpatch()
    assert type(ours).__module__.startswith("vexact_models") and type(from_config) is type(ours)
    assert type(ours.model) is arch.base_model_class
    ids, mask = left_padded()
    ids = ids.masked_fill(mask == 0, 0)
    with torch.no_grad():
        a, b = ours(ids, attention_mask=mask).logits, hf(ids, attention_mask=mask).logits
    if head == "ForTokenClassification":
        a, b = a[mask.bool()], b[mask.bool()]
    assert a.shape == b.shape and rel(a, b) <= 1e-5
    loss = ours(ids, attention_mask=mask, labels=torch.zeros(3, dtype=torch.float32) if head.startswith(
        "ForSeq") else torch.zeros(3, 19, dtype=torch.long)).loss
    assert torch.isfinite(loss)
