"""transformers' continuous-batching ``generate_batch`` on our models (`vexact_models.batch_generation`):
the rollout engine runs it, so its tokens are `LLM`'s and ``generate``'s and its logprobs the training
forward's, bitwise; stock's request ids and order; the ``GenerationConfig`` read as stock's
continuous batching reads it; what the engine's sampler cannot do refused before anything runs."""

import pytest
import torch
import transformers
from transformers import GenerationConfig

from vexact_models import batch_generation
from vexact_models.runtime import LLM, SamplingParams

from ..runtime.llm_support import gen, make_llm, training_logprobs
from .model_support import ARCHS, SHAPES, shape_id, stock_model

pytestmark = pytest.mark.compat

#: transformers' continuous-batching config (from 5.10; 5.2 had none)
CBConfig = getattr(transformers.generation, "ContinuousBatchingConfig", None)
needs_cb_config = pytest.mark.skipif(CBConfig is None, reason="this transformers has no ContinuousBatchingConfig")


def small_stock_cache() -> dict:
    """Stock ``generate_batch``'s arguments for a small KV cache: on the CPU stock sizes its cache
    from the machine's RAM (90% of it), which two test processes at once cannot hold. (5.2 has no
    ``ContinuousBatchingConfig``; its compat run is one process.)"""
    return {} if CBConfig is None else dict(continuous_batching_config=CBConfig(num_blocks=16, max_batch_tokens=64,
                                                                                **pages(16)))


def pages(tokens: int) -> dict:
    """The config field of a page's tokens: ``page_size`` from transformers 5.17, ``block_size`` before."""
    fields = getattr(CBConfig, "__dataclass_fields__", {})
    return {"page_size" if "page_size" in fields else "block_size": tokens}
PROMPTS = [[5, 9, 33, 2, 17], [44, 3, 8], [7, 7, 21, 40, 13, 2, 9, 30]]


def load(arch, shape, path, seed: int = 0):
    """(stock model, ours loaded from its checkpoint at `path`), fp32, eval mode."""
    hf = stock_model(arch, shape=shape, seed=seed)
    hf.save_pretrained(path)
    return hf, arch.causal_lm_class.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="module", params=SHAPES, ids=shape_id)
def pair(request, tmp_path_factory):
    arch, shape = request.param
    return (arch, *load(arch, shape, tmp_path_factory.mktemp(shape_id(request.param).replace(":", "-"))))


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    arch = ARCHS["qwen3"]
    return load(arch, arch.shapes[0], tmp_path_factory.mktemp("qwen3"))[1]


def engines_built(monkeypatch) -> list[LLM]:
    """Every `LLM` built from now on."""
    built, init = [], LLM.__init__

    def counting(self, *args, **kwargs):
        init(self, *args, **kwargs)
        built.append(self)
    monkeypatch.setattr(LLM, "__init__", counting)
    return built


def test_greedy_equals_generate_and_llm_and_logprobs_equal_the_training_forward(pair, monkeypatch):
    """Every architecture: greedy ``generate_batch`` gives each prompt ``generate``'s and `LLM`'s
    tokens, in stock's order of ids, and with ``return_logprobs`` each one is ``token_logprobs``'
    bitwise; the engine is built once for the call and dropped after it."""
    arch, _, ours = pair
    built = engines_built(monkeypatch)
    config = GenerationConfig(do_sample=False, max_new_tokens=6, eos_token_id=-1)
    cb = CBConfig(return_logprobs=True) if CBConfig is not None else None
    out = ours.generate_batch(PROMPTS, generation_config=config, continuous_batching_config=cb)
    assert list(out) == ["req_0", "req_1", "req_2"] and len(built) == 1
    assert batch_generation.ENGINE not in ours.__dict__ and not built[0].runner.kv_caches  # dropped, cache freed
    engine = gen(make_llm(ours), PROMPTS, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    for prompt, result, request in zip(PROMPTS, out.values(), engine):
        assert result.status == transformers.generation.continuous_batching.RequestStatus.FINISHED
        assert result.error is None and result.prompt_ids == prompt
        assert result.generated_tokens == request.outputs[0].token_ids, arch.name
        looped = ours.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, eos_token_id=None)
        assert looped[0, len(prompt):].tolist() == result.generated_tokens
        if cb is not None:
            assert torch.equal(torch.tensor(result.logprobs),
                               training_logprobs(ours, prompt, result.generated_tokens, 1.0)), arch.name


def test_greedy_equals_stock_continuous_batching_on_the_stock_model(tmp_path):
    """Stock's ``generate_batch`` on the stock model (its own paged runtime) gives our tokens; so
    does HF's ``generate(cache_implementation="paged")``, which switches to ``generate_batch``
    (passing its generation arguments and the tokenizer's all-ones mask along)."""
    arch = ARCHS["qwen3"]
    hf, ours = load(arch, arch.shapes[0], tmp_path)
    config = GenerationConfig(do_sample=False, max_new_tokens=6, eos_token_id=-1)
    stock = hf.generate_batch(PROMPTS, generation_config=config, **small_stock_cache())
    ours_out = ours.generate_batch(PROMPTS, generation_config=config)
    assert list(stock) == list(ours_out)
    assert [r.generated_tokens for r in ours_out.values()] == [r.generated_tokens for r in stock.values()]
    assert all(len(r.generated_tokens) == 6 for r in stock.values())
    ids = torch.tensor([PROMPTS[0][:4], PROMPTS[2][:4]])
    paged = dict(attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False, eos_token_id=-1,
                 cache_implementation="paged", **small_stock_cache())
    assert torch.equal(ours.generate(ids, **paged), hf.generate(ids, **paged))


def test_generation_config_fields_as_arguments_apply_to_a_copy(qwen3):
    """``generate_batch(prompts, max_new_tokens=..., do_sample=..., ...)`` sets those fields on a copy
    of the config (the model's own is left as it was); a padded ``attention_mask`` is refused."""
    before = qwen3.generation_config.to_dict()
    out = qwen3.generate_batch(PROMPTS, max_new_tokens=3, do_sample=True, temperature=0.5, eos_token_id=-1,
                               num_return_sequences=2)
    assert len(out) == 6 and all(len(r.generated_tokens) == 3 for r in out.values())
    assert qwen3.generation_config.to_dict() == before
    with pytest.raises(ValueError, match="attention_mask has padding"):
        qwen3.generate_batch(PROMPTS[:2], attention_mask=torch.tensor([[1, 1], [0, 1]]))


@needs_cb_config
def test_sampled_samples_are_the_engines_with_stock_ids_and_seeds(qwen3):
    """``num_return_sequences=3``: ids ``req_i__child#0``, ``#1``, then ``req_i``, the engine's
    n=3 samples of request i (seed ``seed + i``), its logprobs ``token_logprobs``' at the
    temperature; the same seed repeats the call, another does not."""
    config = GenerationConfig(do_sample=True, temperature=0.7, top_k=20, top_p=0.9, min_p=0.01,
                              repetition_penalty=1.1, num_return_sequences=3, max_new_tokens=5, eos_token_id=-1)
    out = qwen3.generate_batch(PROMPTS[:2], generation_config=config,
                               continuous_batching_config=CBConfig(seed=11, return_logprobs=True))
    assert list(out) == ["req_0__child#0", "req_0__child#1", "req_0", "req_1__child#0", "req_1__child#1", "req_1"]
    for i, prompt in enumerate(PROMPTS[:2]):
        params = SamplingParams(n=3, temperature=0.7, top_k=20, top_p=0.9, min_p=0.01, repetition_penalty=1.1,
                                max_tokens=5, ignore_eos=True, seed=11 + i)
        samples = gen(make_llm(qwen3), [prompt], params)[0].outputs
        ours = [out[f"req_{i}__child#0"], out[f"req_{i}__child#1"], out[f"req_{i}"]]
        assert [r.generated_tokens for r in ours] == [s.token_ids for s in samples[1:] + samples[:1]]
        for r in ours:
            assert torch.equal(torch.tensor(r.logprobs), training_logprobs(qwen3, prompt, r.generated_tokens, 0.7))
    again = qwen3.generate_batch(PROMPTS[:2], generation_config=config, continuous_batching_config=CBConfig(seed=11))
    other = qwen3.generate_batch(PROMPTS[:2], generation_config=config, continuous_batching_config=CBConfig(seed=12))
    tokens = [r.generated_tokens for r in out.values()]
    assert [r.generated_tokens for r in again.values()] == tokens != [r.generated_tokens for r in other.values()]
    assert all(r.logprobs == [] for r in again.values())  # without return_logprobs, as stock


def test_without_a_seed_torch_manual_seed_repeats_a_call(qwen3):
    config = GenerationConfig(do_sample=True, temperature=1.0, max_new_tokens=8, eos_token_id=-1)
    runs = []
    for seed in (3, 3, 4):
        torch.manual_seed(seed)
        runs.append([r.generated_tokens for r in qwen3.generate_batch(PROMPTS, generation_config=config).values()])
    assert runs[0] == runs[1] != runs[2]


def test_eos_ends_a_sample_after_min_new_tokens(qwen3):
    """The generation config's ``eos_token_id`` (a list too) ends a sample, the token kept, as
    stock's; ``min_new_tokens`` bans it until that many tokens precede it; unset, the model
    config's ends it."""
    free = qwen3.generate_batch([PROMPTS[0]], generation_config=GenerationConfig(max_new_tokens=8, eos_token_id=-1))
    tokens = free["req_0"].generated_tokens
    stop = tokens[2]
    first = tokens.index(stop)
    ended = qwen3.generate_batch([PROMPTS[0]], generation_config=GenerationConfig(max_new_tokens=8, eos_token_id=[stop]))
    assert ended["req_0"].generated_tokens == tokens[:first + 1]
    late = GenerationConfig(max_new_tokens=8, eos_token_id=stop, min_new_tokens=first + 2)
    banned = qwen3.generate_batch([PROMPTS[0]], generation_config=late)["req_0"].generated_tokens
    assert len(banned) > first + 1 and stop not in banned[:first + 2]
    qwen3.config.eos_token_id, saved = stop, qwen3.config.eos_token_id
    try:
        by_model = qwen3.generate_batch([PROMPTS[0]], generation_config=GenerationConfig(max_new_tokens=8))
    finally:
        qwen3.config.eos_token_id = saved
    assert by_model["req_0"].generated_tokens == tokens[:first + 1]


@pytest.mark.parametrize("setting, named", [
    ({"generation_config": GenerationConfig(num_beams=2)}, "num_beams=2"),
    ({"generation_config": GenerationConfig(no_repeat_ngram_size=2)}, "no_repeat_ngram_size=2"),
    ({"generation_config": GenerationConfig(suppress_tokens=[3])}, "suppress_tokens=[3]"),
    ({"generation_config": GenerationConfig(do_sample=True, typical_p=0.5)}, "typical_p=0.5"),
    ({"generation_config": GenerationConfig(bad_words_ids=[[4]])}, "bad_words_ids=[[4]]"),
    ({"generation_config": GenerationConfig(do_sample=True, top_p=0.0)}, "top_p=0.0"),
    ({"max_new_tokens": 0}, "max_new_tokens=0"),
    ({"record_timestamps": True}, "record_timestamps=True"),
    ({"logits_processor": []}, "logits_processor"),
], ids=["beams", "ngram", "suppress", "typical_p", "bad_words", "top_p", "max_new_tokens", "timestamps", "unexpected"])
def test_what_the_engine_cannot_do_is_refused_naming_it_before_anything_runs(qwen3, monkeypatch, setting, named):
    built = engines_built(monkeypatch)
    weights = [p.data_ptr() for p in qwen3.parameters()]
    with pytest.raises(ValueError, match="generate_batch|SamplingParams") as error:
        qwen3.generate_batch(PROMPTS, **setting)
    assert named in str(error.value)
    assert not built and [p.data_ptr() for p in qwen3.parameters()] == weights  # no engine, no fused projections
    with pytest.raises(ValueError, match="inputs must be a list"):
        qwen3.generate_batch(torch.tensor(PROMPTS[:1]))
    assert qwen3.generate_batch([]) == {} and not built


@pytest.mark.parametrize("method", ["init_continuous_batching", "continuous_batching_context_manager"])
def test_the_streaming_manager_is_refused_naming_what_to_use(qwen3, method):
    with pytest.raises(ValueError, match="generate_batch.*vexact_models.LLM"):
        getattr(qwen3, method)()


@needs_cb_config
def test_a_persistent_manager_keeps_one_engine_until_destroyed(qwen3, monkeypatch):
    """``persistent_manager=True`` keeps the engine (its ids continue, as stock's manager's), a call
    asking for other sizes builds a new one, ``destroy_cached_continuous_batching_manager`` frees
    it; ``num_blocks`` x ``page_size`` tokens size its KV cache."""
    built = engines_built(monkeypatch)
    config = GenerationConfig(max_new_tokens=3, eos_token_id=-1)
    cb = CBConfig(num_blocks=5, max_batch_tokens=96, **pages(16))
    first = qwen3.generate_batch(PROMPTS[:2], generation_config=config, continuous_batching_config=cb,
                                 persistent_manager=True)
    second = qwen3.generate_batch(PROMPTS, generation_config=config, continuous_batching_config=cb,
                                  persistent_manager=True)
    assert list(first) == ["req_0", "req_1"] and list(second) == ["req_2", "req_3", "req_4"] and len(built) == 1
    engine = built[0]
    assert engine.engine_config.max_num_batched_tokens == 96
    assert engine.engine_config.num_blocks == -(-80 // engine.engine_config.block_size)
    assert qwen3.__dict__[batch_generation.ENGINE].llm is engine and engine.runner.kv_caches
    qwen3.generate_batch(PROMPTS, generation_config=config, continuous_batching_config=CBConfig(max_batch_tokens=64),
                         persistent_manager=True)
    assert len(built) == 2 and not engine.runner.kv_caches  # other sizes: a new engine, the old one freed
    qwen3.destroy_cached_continuous_batching_manager()
    assert batch_generation.ENGINE not in qwen3.__dict__ and not built[1].runner.kv_caches
    assert [r.generated_tokens for r in first.values()] == [r.generated_tokens for r in second.values()][:2]


def test_the_engine_lifetime_switch_keeps_engines_for_callers_that_cannot_ask(qwen3, monkeypatch):
    """``VEXACT_GENERATE_BATCH_ENGINE=kept``: calls without ``persistent_manager`` (TRL's) keep one
    engine, with the same tokens; a value outside its modes is refused naming it."""
    built = engines_built(monkeypatch)
    config = GenerationConfig(max_new_tokens=3, eos_token_id=-1)
    fresh = [qwen3.generate_batch(PROMPTS, generation_config=config) for _ in range(2)]
    assert len(built) == 2 and batch_generation.ENGINE not in qwen3.__dict__
    monkeypatch.setenv("VEXACT_GENERATE_BATCH_ENGINE", "kept")
    kept = [qwen3.generate_batch(PROMPTS, generation_config=config) for _ in range(2)]
    assert len(built) == 3 and qwen3.__dict__[batch_generation.ENGINE].llm is built[2]
    assert [[r.generated_tokens for r in o.values()] for o in kept] == \
        [[r.generated_tokens for r in o.values()] for o in fresh]
    qwen3.destroy_cached_continuous_batching_manager()
    monkeypatch.setenv("VEXACT_GENERATE_BATCH_ENGINE", "always")
    with pytest.raises(ValueError, match="VEXACT_GENERATE_BATCH_ENGINE='always'.*'call', 'kept'"):
        qwen3.generate_batch(PROMPTS, generation_config=config)


@needs_cb_config
def test_engine_settings_keep_what_was_asked_not_what_it_came_to():
    """A kept engine is reused by a call asking for the same: the KV budget as asked (a share of
    the free memory, which the kept engine's own cache changes, or num_blocks x page_size
    tokens), sequences per step capped at the call's requests only when not kept."""
    share = CBConfig(max_memory_percent=0.5, max_batch_tokens=64)
    kept = batch_generation.engine_settings(share, 3, persistent=True)
    assert kept == batch_generation.engine_settings(share, 7, persistent=True)
    assert (kept.kv_memory_share, kept.kv_tokens, kept.max_num_seqs, kept.max_num_batched_tokens) == (0.5, None, 256, 64)
    blocks = batch_generation.engine_settings(CBConfig(num_blocks=4, max_memory_percent=0.5, **pages(16)), 3, False)
    assert (blocks.kv_tokens, blocks.kv_memory_share, blocks.max_num_seqs) == (64, None, 3)
    assert batch_generation.engine_settings(None, 2, False) == batch_generation.BatchEngineSettings(
        max_num_seqs=2, max_num_batched_tokens=8192, enforce_eager=False, enable_prefix_sharing=True,
        cuda_graph_sizes=batch_generation.CALL_GRAPH_SIZES)
    assert kept.cuda_graph_sizes is None  # a kept engine's build is paid once: LLM's default sizes
    eager = batch_generation.engine_settings(CBConfig(use_cuda_graph=(True, False), allow_block_sharing=False), 1, False)
    assert eager.enforce_eager and not eager.enable_prefix_sharing


@needs_cb_config
def test_lora_adapters_take_part_as_in_training(tmp_path):
    """A PEFT model's ``generate_batch`` (PEFT passes it to the model it wraps) runs the active
    adapters: its logprobs are the LoRA model's ``token_logprobs``, not the base model's."""
    peft = pytest.importorskip("peft")
    arch = ARCHS["qwen3"]
    _, ours = load(arch, arch.shapes[0], tmp_path)
    torch.manual_seed(0)
    model = peft.get_peft_model(ours, peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                      init_lora_weights=False))
    config = GenerationConfig(do_sample=True, temperature=1.0, max_new_tokens=6, eos_token_id=-1)
    out = model.generate_batch(PROMPTS, generation_config=config,
                               continuous_batching_config=CBConfig(seed=0, return_logprobs=True))
    with model.disable_adapter():
        base = model.generate_batch(PROMPTS, generation_config=config,
                                    continuous_batching_config=CBConfig(seed=0, return_logprobs=True))
    for prompt, lora, plain in zip(PROMPTS, out.values(), base.values()):
        assert torch.equal(torch.tensor(lora.logprobs), training_logprobs(model, prompt, lora.generated_tokens, 1.0))
        with model.disable_adapter():
            assert torch.equal(torch.tensor(plain.logprobs),
                               training_logprobs(model, prompt, plain.generated_tokens, 1.0))
    assert [r.logprobs for r in out.values()] != [r.logprobs for r in base.values()]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the Triton kernels, CUDA graphs)")
@needs_cb_config
@pytest.mark.parametrize("name, dims", [("qwen3", dict(head_dim=64)), ("qwen3_5", dict(head_dim=64))])
def test_gpu_sampled_rollouts_under_cuda_graphs_equal_the_training_forward(name, dims):
    """On CUDA in bf16, as TRL calls it (``max_memory_percent=0.5``, the engine's CUDA graphs):
    40 sampled tokens of 24 requests, every logprob bitwise ``token_logprobs``'."""
    torch.manual_seed(0)
    arch = ARCHS[name]
    model = arch.causal_lm_class(arch.tiny_config(initializer_range=0.5, **dims)).to("cuda", torch.bfloat16).eval()
    prompts = [torch.randint(2, 500, (n,)).tolist() for n in range(3, 150, 6)]
    config = GenerationConfig(do_sample=True, temperature=0.9, top_p=0.95, max_new_tokens=40, eos_token_id=-1)
    out = model.generate_batch(prompts, generation_config=config,
                               continuous_batching_config=CBConfig(max_memory_percent=0.5, seed=1, return_logprobs=True))
    assert len(out) == len(prompts)
    for prompt, result in zip(prompts, out.values()):
        assert len(result.generated_tokens) == 40
        assert torch.equal(torch.tensor(result.logprobs), training_logprobs(model, prompt, result.generated_tokens, 0.9))
    built = []
    for _ in range(2):  # kept: one engine, though its own cache takes the free memory it was a share of
        kept = model.generate_batch(prompts, generation_config=config, persistent_manager=True,
                                    continuous_batching_config=CBConfig(max_memory_percent=0.5, seed=1))
        built.append(model.__dict__[batch_generation.ENGINE].llm)
    model.destroy_cached_continuous_batching_manager()
    assert built[0] is built[1] and [r.generated_tokens for r in kept.values()] == [r.generated_tokens
                                                                                   for r in out.values()]
