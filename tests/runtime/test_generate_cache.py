"""`runtime.generate_cache.GenerateCache` driven step by step, as HF's ``generate`` drives a
model's forward: each answer is bitwise the whole forward's last-column logits, and what it runs
is only what the previous step did not (tests/models/test_hf_drop_in.py runs it through
``generate`` for every architecture)."""

import pytest
import torch

from vexact_models.registry import get
from vexact_models.runtime.generate_cache import GenerateCache

ARCHS = ["qwen3", "qwen3_5", "deepseek_v3"]  # GQA pages; gated-DeltaNet states beside them; MLA's latent pages


@pytest.fixture(scope="module", params=ARCHS)
def model(request):
    torch.manual_seed(0)
    arch = get(request.param)
    overrides = {"initializer_range": 0.5}
    if request.param == "deepseek_v3":
        overrides["mla_kv_cache"] = "latent"
    return arch.causal_lm_class(arch.tiny_config(**overrides)).eval()


def whole(model, ids, mask, **kwargs) -> torch.Tensor:
    with torch.no_grad():
        return model(ids, attention_mask=mask, logits_to_keep=1, **kwargs).logits


def grown(ids: torch.Tensor, mask: torch.Tensor, columns: int, seed: int):
    """`ids` and `mask` with `columns` more columns of real tokens, as generate appends them."""
    new = torch.randint(2, 100, (ids.shape[0], columns), generator=torch.Generator().manual_seed(seed))
    return torch.cat([ids, new], 1), torch.cat([mask, torch.ones_like(new)], 1)


def padded_prompts():
    ids = torch.randint(2, 100, (3, 7), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    mask[2, :] = 0  # a row with no token yet
    return ids, mask


def test_steps_equal_the_whole_forward_and_run_only_new_tokens_while_pages_grow(model):
    cache = GenerateCache(model)
    ids, mask = padded_prompts()
    assert torch.equal(cache.logits(ids, None, mask, None), whole(model, ids, mask))
    assert cache.tokens_run == 12 and cache.logits(ids, None, mask, None) is not None  # the same input: a prefill again
    first_pages = cache.pages_per_row
    run = 24
    for step in range(9):  # one column a step, then a few at once: past the first pages, which double
        ids, mask = grown(ids, mask, 1 if step < 6 else 40, seed=step)
        expected_run = run + 3 * (ids.shape[1] - cache._previous[0].shape[1])
        assert torch.equal(cache.logits(ids, None, mask, None), whole(model, ids, mask)), step
        assert cache.tokens_run == expected_run
        run = expected_run
    assert cache.pages_per_row > first_pages and list(cache.lengths) == [ids.shape[1], ids.shape[1] - 2,
                                                                          ids.shape[1] - 7]


def test_a_changed_prefix_or_reordered_rows_start_over(model):
    cache = GenerateCache(model)
    ids, mask = padded_prompts()
    cache.logits(ids, None, mask, None)
    ids, mask = grown(ids, mask, 1, seed=3)
    reordered, reordered_mask = ids[[1, 0, 2]], mask[[1, 0, 2]]  # a beam search's reorder
    assert torch.equal(cache.logits(reordered, None, reordered_mask, None), whole(model, reordered, reordered_mask))
    assert cache.tokens_run == 12 + 15
    changed = reordered.clone()
    changed[0, 4] += 1
    grown_ids, grown_mask = grown(changed, reordered_mask, 1, seed=4)
    assert torch.equal(cache.logits(grown_ids, None, grown_mask, None), whole(model, grown_ids, grown_mask))
    assert cache.tokens_run == 27 + 18
    two = grown_ids[:2]
    assert torch.equal(cache.logits(two, None, grown_mask[:2], None), whole(model, two, grown_mask[:2]))
    assert cache.rows == 2 and cache.tokens_run == 45 + 16


def test_last_columns_of_padding_give_zeros_as_the_whole_forward(model):
    """Right padding: a row whose last column is padding gets zero logits (the padded output's
    zeros), and its next real token continues at the position after its last real one."""
    cache = GenerateCache(model)
    ids, mask = padded_prompts()
    cache.logits(ids, None, mask, None)
    ids, mask = grown(ids, mask, 2, seed=5)
    mask[0, -1] = 0
    out = cache.logits(ids, None, mask, None)
    assert torch.equal(out, whole(model, ids, mask)) and not out[0].any() and out[1].any()
    ids, mask = grown(ids, mask, 1, seed=6)
    assert torch.equal(cache.logits(ids, None, mask, None), whole(model, ids, mask))
    assert cache.tokens_run == 12 + 5 + 3


def test_embeddings_continue_as_ids_do(model):
    cache, by_ids = GenerateCache(model), GenerateCache(model)
    ids, mask = padded_prompts()
    for step in range(3):
        if step:
            ids, mask = grown(ids, mask, 1, seed=step)
        embeds = model.get_input_embeddings()(ids).detach()
        assert torch.equal(cache.logits(None, embeds, mask, None), by_ids.logits(ids, None, mask, None))
    assert cache.tokens_run == by_ids.tokens_run == 12 + 3 + 3


def test_inputs_it_does_not_take_are_left_to_the_whole_forward(model):
    """None (and the next step a prefill) for other position ids or a mask of another shape; the
    position ids HF makes (each row's count of real tokens before, anything at padding) are taken."""
    cache = GenerateCache(model)
    ids, mask = padded_prompts()
    hf_positions = (mask.cumsum(1) - 1).masked_fill(mask == 0, 1)
    assert torch.equal(cache.logits(ids, None, mask, hf_positions), whole(model, ids, mask))
    ids, mask = grown(ids, mask, 1, seed=7)
    assert cache.logits(ids, None, mask, (mask.cumsum(1) - 1) + 3) is None
    assert cache.logits(ids, None, mask[:, 1:], None) is None
    assert cache.logits(ids[0], None, None, None) is None
    assert torch.equal(cache.logits(ids, None, mask, None), whole(model, ids, mask))
    assert cache.tokens_run == 12 + 15


def test_a_model_cast_between_steps_starts_over(model):
    """Pages hold K/V of the dtype they were made for: after the model is cast, the next step is
    a prefill of everything into new pages, bitwise the cast model's whole forward."""
    import copy

    cast = copy.deepcopy(model)
    cache = GenerateCache(cast)
    ids, mask = padded_prompts()
    cache.logits(ids, None, mask, None)
    cast.to(torch.bfloat16)
    ids, mask = grown(ids, mask, 1, seed=9)
    assert torch.equal(cache.logits(ids, None, mask, None), whole(cast, ids, mask))
    assert cache.tokens_run == 12 + 15
    assert next(pair for pair in cache.kv_caches if pair is not None)[0].dtype == torch.bfloat16


def test_a_bad_token_id_is_refused_before_anything_changes(model):
    cache = GenerateCache(model)
    ids, mask = padded_prompts()
    cache.logits(ids, None, mask, None)
    ids, mask = grown(ids, mask, 1, seed=8)
    bad = ids.clone()
    bad[0, -1] = model.config.vocab_size
    with pytest.raises(ValueError, match=f"token id {model.config.vocab_size}, outside the vocabulary"):
        cache.logits(bad, None, mask, None)
    assert torch.equal(cache.logits(ids, None, mask, None), whole(model, ids, mask))
    assert cache.tokens_run == 12 + 3


#: head dims the GPU kernels take: 64 for the Triton attention, DeepSeek-V3's own for the latent MLA
GPU_DIMS = {"qwen3": dict(head_dim=64), "qwen3_5": dict(head_dim=64),
            "deepseek_v3": dict(qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, kv_lora_rank=512,
                                mla_kv_cache="latent")}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the Triton paged kernels)")
@pytest.mark.parametrize("name", ARCHS)
def test_gpu_generate_steps_over_its_cache_with_the_whole_recomputes_and_the_rollouts_bits(name):
    """On CUDA in bf16 (the Triton paged prefill and decode, the GDN step kernels): ``generate``'s
    logits bitwise ``use_cache=False``'s over 40 steps of left-padded prompts of 3 to 150 tokens,
    its greedy tokens the engine's."""
    from vexact_models.runtime import LLM, SamplingParams

    torch.manual_seed(0)
    arch = get(name)
    model = arch.causal_lm_class(arch.tiny_config(initializer_range=0.5, **GPU_DIMS[name])).to("cuda", torch.bfloat16)
    prompts = [torch.randint(2, 500, (n,)).tolist() for n in (70, 3, 150)]
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device="cuda")
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device="cuda")
    kwargs = dict(attention_mask=mask, max_new_tokens=40, do_sample=False, eos_token_id=None, pad_token_id=0,
                  output_logits=True, return_dict_in_generate=True)
    cached, whole = (model.eval().generate(ids, use_cache=use_cache, **kwargs) for use_cache in (True, False))
    assert torch.equal(cached.sequences, whole.sequences)
    assert all(torch.equal(a, b) for a, b in zip(cached.logits, whole.logits, strict=True))
    llm = LLM(model, enforce_eager=True, kv_cache_bytes=1 << 28)
    rollout = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True), use_tqdm=False)
    assert [row[width:].tolist() for row in cached.sequences] == [o.outputs[0].token_ids for o in rollout]
