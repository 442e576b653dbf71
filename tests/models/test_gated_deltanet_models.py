"""What is specific to the gated-DeltaNet hybrids (Qwen3.5, Qwen3.5-MoE, Qwen3-Next) beyond the
shared architecture tests: HF parity over sequences that cross the gated delta rule's chunk
boundaries (positions 64, 128), packed and padded alike; the text part of Qwen3.5's multimodal
checkpoints; the published configs; layer_types checks; the rollout engine's refusal of the features
it lacks for them."""

import copy
import logging

import pytest
import torch
import transformers

from vexact_models.registry import architectures, get

from .model_support import rel, stock_model

pytestmark = pytest.mark.compat

HYBRIDS = [arch for arch in architectures() if arch.name in ("qwen3_5", "qwen3_5_moe", "qwen3_next")]
if not HYBRIDS:  # Architecture.min_transformers: an older release keeps them out of the registry
    pytest.skip(f"the gated-DeltaNet hybrids need a newer transformers than {transformers.__version__}",
                allow_module_level=True)


@pytest.fixture(scope="module", params=HYBRIDS, ids=lambda a: a.name)
def hybrid_pair(request):
    arch = request.param
    hf = stock_model(arch, initializer_range=0.1)
    ours = arch.causal_lm_class(hf.config).eval()
    ours.load_state_dict(hf.state_dict())
    return arch, hf, ours


def test_parity_across_chunk_boundaries(hybrid_pair):
    """Sequences of 150 tokens (three chunks of the gated delta rule) match stock's torch path,
    and each sequence's logprobs are bitwise the same alone, packed and left-padded.

    Over three chunks our chunk arithmetic (the block solve, the fold; docs/design.md section 6b)
    and stock's chunked torch path round differently in fp32 (relative differences of 1e-5 to
    7e-5 with random norms), so parity is judged against stock run in float64: our fp32 logits
    are at most 2x as far from it as stock's own fp32 logits, plus 1e-5 (the other architectures'
    fp32 bound), and within 1e-4 of stock's fp32 logits."""
    _, hf, ours = hybrid_pair
    ids = torch.randint(0, 512, (2, 150))
    with torch.no_grad():
        fp64 = copy.deepcopy(hf).double()
        if getattr(fp64, "_can_set_experts_implementation", lambda: False)():
            fp64.set_experts_implementation("eager")  # torch's grouped_mm takes no float64
        exact = fp64(ids).logits
        stock, mine = hf(ids).logits, ours(ids).logits
        assert rel(mine.double(), exact) <= 2 * rel(stock.double(), exact) + 1e-5, (rel(mine.double(), exact),
                                                                                       rel(stock.double(), exact))
        assert rel(mine, stock) <= 1e-4
        alone = [ours.token_logprobs(row[None])[0] for row in (ids[0], ids[1, 50:])]
        packed = ours.token_logprobs(torch.cat([ids[0], ids[1, 50:]]), cu_seqlens=torch.tensor([0, 150, 250]))
        mask = torch.ones_like(ids)
        mask[1, :50] = 0
        padded = ours.token_logprobs(ids, attention_mask=mask)
    assert torch.equal(packed[:150], alone[0]) and torch.equal(packed[150:], alone[1])
    assert torch.equal(padded[0], alone[0]) and torch.equal(padded[1, 50:], alone[1])


def test_norms_and_gates_are_random_in_the_parity_models(hybrid_pair):
    """The conformance init gives the zero-centred and gated norms and dt_bias random values."""
    _, _, ours = hybrid_pair
    for name, param in ours.named_parameters():
        if name.endswith(("norm.weight", "dt_bias")):
            assert param.std() > 0.05, name


@pytest.mark.parametrize("name, config_class, model_class", [
    ("qwen3_5", "Qwen3_5Config", "Qwen3_5ForConditionalGeneration"),
    ("qwen3_5_moe", "Qwen3_5MoeConfig", "Qwen3_5MoeForConditionalGeneration")])
def test_text_part_of_a_multimodal_checkpoint_loads(name, config_class, model_class, tmp_path, caplog):
    """A multimodal checkpoint written by transformers' own class (model.language_model.*,
    model.visual.*): our text model loads its text part, says once that it skips the vision
    tower, and matches the multimodal model on text input."""
    arch = get(name)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                  temporal_patch_size=2, spatial_merge_size=2, in_channels=3)
    config = getattr(transformers, config_class)(text_config=arch.tiny_config().to_dict(), vision_config=vision)
    torch.manual_seed(0)
    multimodal = getattr(transformers, model_class)(config).eval()
    with torch.no_grad():
        arch.init_for_conformance(multimodal, 0)
    multimodal.save_pretrained(tmp_path)
    with caplog.at_level(logging.WARNING, logger="vexact_models"):
        ours = arch.causal_lm_class.from_pretrained(tmp_path, dtype=torch.float32).eval()
    notices = [r.getMessage() for r in caplog.records if r.name == "vexact_models"]
    assert len(notices) == 1 and "skipping the vision tower" in notices[0]
    assert isinstance(ours.config, arch.config_class)
    ids = torch.randint(0, 512, (2, 20))
    with torch.no_grad():
        assert rel(ours(ids).logits, multimodal(input_ids=ids).logits) <= 1e-5


@pytest.mark.parametrize("arch", HYBRIDS, ids=lambda a: a.name)
def test_published_configs_build_with_stock_names_and_shapes(arch):
    """Each bundled published config, trimmed to its first 4 layers (3 gated DeltaNet, 1 gated
    attention), builds our model with stock's parameter names and shapes (meta device)."""
    from vexact_models.conformance.models import make_config

    for name in arch.published_configs:
        config = make_config(arch, name.removesuffix(".json"), layers=4)
        assert config.layer_types == ["linear_attention"] * 3 + ["full_attention"]
        with torch.device("meta"):
            ours, stock = arch.causal_lm_class(config), arch.hf_class()(config)
        assert {n: p.shape for n, p in ours.named_parameters()} == {n: p.shape for n, p in stock.named_parameters()}


@pytest.mark.parametrize("arch", HYBRIDS, ids=lambda a: a.name)
def test_bad_layer_type_is_an_error_naming_it(arch):
    config = arch.tiny_config()
    config.layer_types = ["linear_attention", "sliding_attention", "linear_attention"]
    with pytest.raises(ValueError, match=r"layer_types\[1\]='sliding_attention'"):
        arch.causal_lm_class(config)


@pytest.mark.parametrize("arch", HYBRIDS, ids=lambda a: a.name)
def test_rollout_engine_refuses_missing_features_before_allocating(arch, tmp_path):
    """Pipeline stages are no missing feature of these models any more (each stage holds its own
    layers' states: tests/distributed/test_pipeline.py): ``pipeline_parallel_size=2`` passes the
    feature check and stops at the missing process group, a ValueError naming the argument, from
    a model and from a folder alike; the training model is left as it was (nothing fused, nothing
    moved). CUDA graphs, the feature still missing, are refused on a GPU
    (tests/runtime/test_linear_state_cache.py)."""
    from vexact_models.runtime import LLM

    assert arch.rollout_feature_missing("pipeline_parallel") is None
    model = arch.causal_lm_class(arch.tiny_config()).eval()
    before = {n: p.data_ptr() for n, p in model.named_parameters()}
    for source in (model, tmp_path):
        if source is tmp_path:
            model.save_pretrained(tmp_path)
        with pytest.raises(ValueError, match="pipeline_parallel_size=2 needs torch.distributed initialised"):
            LLM(source, device="cpu", kv_cache_bytes=1 << 22, pipeline_parallel_size=2)
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == before
    assert arch.inference_class(model).causal_lm is model  # the rollout itself runs (test_conformance)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("arch", HYBRIDS, ids=lambda a: a.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gpu_training_forward_is_batch_invariant_and_matches_stock(arch, dtype):
    """On CUDA (the Triton kernels: conv, gated delta rule rows and fold, gated norm, gates,
    attention): each sequence's token_logprobs are bitwise the same alone, packed and left-padded,
    over chunk boundaries and with a gradient taken; fp32 logits match stock's torch path."""
    hf = stock_model(arch, initializer_range=0.1).cuda()
    ours = arch.causal_lm_class(hf.config).eval()
    ours.load_state_dict(hf.state_dict())
    ours = ours.to("cuda", dtype)
    seqs = [torch.randint(0, 512, (n,), device="cuda") for n in (150, 1, 70, 64)]
    offsets = torch.tensor([0, 150, 151, 221, 285])
    width = 150
    ids = torch.zeros(4, width, dtype=torch.long, device="cuda")
    mask = torch.zeros_like(ids)
    for row, s in enumerate(seqs):
        ids[row, width - len(s):], mask[row, width - len(s):] = s, 1
    with torch.no_grad():
        alone = [ours.token_logprobs(s[None])[0] for s in seqs]
        packed = ours.token_logprobs(torch.cat(seqs), cu_seqlens=offsets)
        padded = ours.token_logprobs(ids, attention_mask=mask)
    with_grad = ours.token_logprobs(torch.cat(seqs), cu_seqlens=offsets)
    with_grad.sum().backward()
    for row, s in enumerate(seqs):
        piece = slice(int(offsets[row]), int(offsets[row + 1]))
        assert torch.equal(packed[piece], alone[row]) and torch.equal(with_grad.detach()[piece], alone[row])
        assert torch.equal(padded[row, width - len(s):], alone[row])
    if dtype == torch.float32:
        with torch.no_grad():
            error = rel(ours(ids[:2]).logits, hf(ids[:2]).logits)
        print(f"{arch.name}: GPU fp32 logits vs stock, rel {error:.2e}")
        assert error <= 5e-5
