"""The conformance suite over the registered (architecture, shape)s (tiny configs, reference
backend) and the library that builds its models (`vexact_models.conformance.models`); its CLI
is tested in test_conformance_cli.py.

The full suite runs at every shape whose module tree differs (`DISTINCT_SHAPES`: DeepSeek-V3's
q-LoRA and Moonlight's q_proj both, a tied head not), the CLI test at every shape. A new
architecture or shape that registers itself is picked up here with no edit.
"""

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import vexact_models
from vexact_models.conformance.models import (architecture_of, build_model, bundled_configs, construct, hf_twin,
                                              make_config, published_config, published_shape)
from vexact_models.conformance.suite import format_table, run_conformance, scenario_names, select_scenarios
from vexact_models.gated_deltanet import linear_chunk_size
from vexact_models.kernels import GATED_DELTA_CHUNK
from vexact_models.registry import get

from ..models.model_support import DISTINCT_SHAPES, SHAPES, adapts_experts, shape_id


@pytest.mark.parametrize("case", DISTINCT_SHAPES, ids=shape_id)
def test_rollout_logprobs_equal_training_logprobs_bitwise(case):
    arch, shape = case
    model = build_model(arch, shape.tiny_config(), torch.device("cpu"), torch.float32)
    report = run_conformance(arch, model, device=torch.device("cpu"), pool_size=64, max_tokens=20, prompt_len=40,
                             shape=shape.name)
    names = " | ".join(s.name for s in report.scenarios)
    assert "preemptions" in names, "the preemption scenario must actually preempt"
    assert report.tokens > 5000
    assert report.mismatches == 0, [(s.name, s.mismatches, s.max_abs_diff) for s in report.scenarios]
    assert report.reproducibility_checked > 100 and report.reproducibility_mismatches == 0
    assert report.hf_parity is not None and report.hf_parity.vs_hf <= 1e-5 and report.ok
    assert report.shape == shape.name and f" {shape.name} " in format_table([report]).splitlines()[1]


def test_suite_detects_a_batch_dependent_kernel(monkeypatch):
    """Swap the reference GEMM for BLAS (rows change with M): the suite must report mismatches."""
    import importlib

    linear_module = importlib.import_module("vexact_models.kernels.linear")  # the module, not the function

    def blas_linear(x2d, weight, bias, out_dtype):
        out = x2d.float() @ weight.float().T
        return (out if bias is None else out + bias.float()).to(out_dtype)

    monkeypatch.setattr(linear_module, "linear_reference", blas_linear)
    arch = get("qwen3")
    config = arch.tiny_config(hidden_size=256, intermediate_size=512, num_attention_heads=4, head_dim=64)
    model = build_model(arch, config, torch.device("cpu"), torch.float32)
    report = run_conformance(arch, model, device=torch.device("cpu"), pool_size=16, max_tokens=8, check_parity=False)
    assert report.mismatches > 0


def test_every_bundled_config_belongs_to_one_shape():
    """``--config NAME`` picks the architecture and shape: each bundled config is listed by
    exactly one shape, of the architecture serving its model_type."""
    listed = [(arch, shape, name) for arch, shape in SHAPES for name in shape.published_configs]
    assert sorted(name for _, _, name in listed) == sorted(f"{n}.json" for n in bundled_configs())
    for arch, shape, name in listed:
        assert published_shape(name.removesuffix(".json")) == (arch, shape), name
        assert architecture_of(name.removesuffix(".json")) is arch
    assert published_shape("moonlight-16b-a3b") == (get("deepseek_v3"), get("deepseek_v3").shape("moonlight"))


@pytest.mark.parametrize("case", SHAPES, ids=shape_id)
def test_make_config(case):
    arch, shape = case
    tiny = make_config(arch, None, 1, None, {"vocab_size": 320}, shape=shape.name)
    assert (tiny.num_hidden_layers, tiny.vocab_size) == (1, 320)
    assert tiny.to_dict() == shape.tiny_config(num_hidden_layers=1, vocab_size=320).to_dict()
    for name in shape.published_configs:
        config = make_config(arch, name.removesuffix(".json"), 2, 4096)
        assert config.num_hidden_layers == 2 and config.max_position_embeddings == 4096
        assert config.model_type in arch.model_types
        published = published_config(name.removesuffix(".json"))
        assert config.hidden_size == published["hidden_size"] and config.vocab_size == published["vocab_size"]


def test_make_config_errors_name_the_config():
    qwen3 = get("qwen3")
    with pytest.raises(ValueError, match="no such file, and not one of the bundled configs"):
        make_config(qwen3, "nope")
    with pytest.raises(ValueError, match="model_type 'deepseek_v3' is not one of architecture 'qwen3'"):
        make_config(qwen3, "moonlight-16b-a3b")
    with pytest.raises(ValueError, match="architecture 'qwen3' has no shape 'moonlight'"):
        make_config(qwen3, shape="moonlight")


def test_published_shape_needs_a_registered_model_type(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError, match="no registered architecture serves model_type 'gpt2'"):
        published_shape(str(path))


@pytest.mark.parametrize("name", ["qwen3_5", "gemma3"])
def test_a_multimodal_config_gives_its_text_model(name, tmp_path):
    """``--config path`` of a published multimodal config.json (Qwen3.5's; Gemma 3 4B+'s short
    ``text_config`` form, a legacy ``rope_scaling`` in it): the text model's architecture and
    config, as the multimodal config class builds it."""
    import transformers

    if name not in {a.name for a, _ in SHAPES}:
        pytest.skip(f"{name} is not registered on this transformers")
    arch = get(name)
    if name == "gemma3":
        text = {"hidden_size": 64, "intermediate_size": 128, "model_type": "gemma3_text", "num_hidden_layers": 6,
                "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 32}
        stored = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "text_config": text,
                  "mm_tokens_per_image": 256, "vision_config": {"model_type": "siglip_vision_model"}}
    else:
        stored = transformers.Qwen3_5Config(text_config=arch.tiny_config().to_dict()).to_dict()
    path = tmp_path / "config.json"
    path.write_text(json.dumps(stored))
    assert published_shape(str(path)) == (arch, None)
    config = make_config(arch, str(path), 2)
    want = transformers.AutoConfig.from_pretrained(tmp_path).get_text_config()
    assert type(config) is arch.config_class and config.num_hidden_layers == 2
    assert {k: v for k, v in config.to_dict().items() if k not in ("num_hidden_layers", "layer_types")} == \
        {k: v for k, v in want.to_dict().items() if k not in ("num_hidden_layers", "layer_types")}
    if arch.name == "gemma3":
        assert config.rope_parameters["full_attention"]["factor"] == 8.0


def test_construct_builds_on_the_device_in_the_dtype_and_restores_the_default():
    arch = get("qwen3")
    model = construct(arch.causal_lm_class, arch.tiny_config(), torch.device("meta"), torch.bfloat16)
    assert {p.device.type for p in model.parameters()} == {"meta"}
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert torch.get_default_dtype() == torch.float32


def test_hf_twin_is_the_stock_class_on_our_weights_and_refuses_other_weights():
    arch = get("qwen3")
    model = build_model(arch, arch.tiny_config(), torch.device("cpu"), torch.float32)
    twin = hf_twin(arch, model, dtype=torch.bfloat16, attn_implementation="eager")
    assert type(twin) is arch.hf_class() and twin.config._attn_implementation == "eager"
    assert {p.dtype for p in twin.parameters()} == {torch.bfloat16}
    assert torch.equal(twin.model.embed_tokens.weight, model.model.embed_tokens.weight.bfloat16())
    extra = dict(model.state_dict(), **{"model.extra.weight": torch.zeros(1)})
    model.state_dict = lambda: extra
    with pytest.raises(RuntimeError, match="hf_twin: state dicts differ.*model.extra.weight"):
        hf_twin(arch, model)


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen3_5_moe"])
def test_hf_twin_runs_stock_experts_default_only_when_asked(name):
    """Our MoE configs name ``eager`` experts (stock's loop over experts: the parity reference);
    with ``stock_experts`` the twin takes the implementation stock picks for its own config, as
    the benchmarks' peer must, and computes the same logits within fp32 rounding."""
    arch = get(name)
    model = build_model(arch, arch.tiny_config(), torch.device("cpu"), torch.float32)
    stock_default = arch.hf_class()(arch.tiny_config()).config._experts_implementation
    assert stock_default != "eager"  # transformers >= 5: grouped_mm
    reference = hf_twin(arch, model)
    peer = hf_twin(arch, model, attn_implementation="eager", stock_experts=True)
    assert reference.config._experts_implementation == model.config._experts_implementation == "eager"
    assert peer.config._experts_implementation == stock_default
    assert model.config._attn_implementation == "sdpa"  # our config untouched by the twins
    ids = torch.randint(0, arch.tiny_config().vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = reference(ids).logits, peer(ids).logits
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


def test_low_precision_parity_is_judged_against_hf_own_error():
    from vexact_models.conformance.suite import hf_parity

    arch = get("qwen3")
    model = build_model(arch, arch.tiny_config(), torch.device("cpu"), torch.bfloat16)
    parity = hf_parity(arch, model, torch.device("cpu"))
    assert parity.ours_vs_fp32 is not None and parity.hf_vs_fp32 > 0
    assert parity.ok(), str(parity)


def test_build_model_goes_through_patch_and_restores_the_auto_classes():
    import vexact_models

    arch = get("qwen3")
    assert not vexact_models.is_patched()
    model = build_model(arch, arch.tiny_config(), torch.device("cpu"), torch.float32)
    assert type(model) is arch.causal_lm_class and not vexact_models.is_patched()


@pytest.mark.parametrize("case", DISTINCT_SHAPES, ids=shape_id)
def test_lora_adapters_in_every_scenario(case):
    """Every suite scenario with random PEFT LoRA adapters (all-linear, and both fused expert
    tensors of a MoE model: `add_random_lora`) at every architecture's distinct shapes: rollouts
    (the fused groups' adapters stacked) bitwise the training recompute (per member)."""
    from vexact_models.adapters import expert_target_parameters
    from vexact_models.conformance.models import add_random_lora

    arch, shape = case
    model = build_model(arch, shape.tiny_config(), torch.device("cpu"), torch.float32)
    fused_experts = expert_target_parameters(model) is not None
    model = add_random_lora(model, 4)
    assert adapts_experts(model) == fused_experts
    report = run_conformance(arch, model, device=torch.device("cpu"), pool_size=8, max_tokens=6, prompt_len=8,
                             check_parity=False, shape=shape.name)
    assert report.scenarios and report.mismatches == 0 and report.tokens > 0, format_table([report])


def test_config_overrides_take_the_config_class_fields_and_ours_only():
    """`make_config` applies an override of a field the config class has, of the published config
    it changes, or of `VEXACT_CONFIG_FIELDS`; any other name is refused before a model is built."""
    from vexact_models.conformance.models import VEXACT_CONFIG_FIELDS

    deepseek = get("deepseek_v3")
    config = make_config(deepseek, "moonlight-16b-a3b", 1, None, {"n_routed_experts": 8, "mla_kv_cache": "expanded"})
    assert config.n_routed_experts == 8 and config.mla_kv_cache == "expanded" and config.num_hidden_layers == 1
    assert make_config(get("qwen3_5"), None, None, None, {"linear_chunk_size": 32}).linear_chunk_size == 32
    with pytest.raises(ValueError, match="config override n_routed_expert=8: DeepseekV3Config has no field"):
        make_config(deepseek, "moonlight-16b-a3b", 1, None, {"n_routed_expert": 8})
    with pytest.raises(ValueError, match="layers=0 must be >= 1"):
        make_config(deepseek, None, 0)
    # our fields' values are checked by the readers the models use, before a model is built
    with pytest.raises(ValueError, match="mla_kv_cache='bogus' is not an MLA KV cache mode"):
        make_config(deepseek, None, None, None, {"mla_kv_cache": "bogus"})
    with pytest.raises(ValueError, match="linear_chunk_size=24 must be a power of two >= 16"):
        make_config(get("qwen3_5"), None, None, None, {"linear_chunk_size": 24})
    for bad in (True, 32.0, "32", 8):
        with pytest.raises(ValueError, match=f"linear_chunk_size={bad!r} must be a power of two >= 16"):
            linear_chunk_size(SimpleNamespace(linear_chunk_size=bad))
    size = linear_chunk_size(SimpleNamespace(linear_chunk_size=np.int64(32)))  # a config built with numpy
    assert size == 32 and type(size) is int
    assert linear_chunk_size(SimpleNamespace()) == GATED_DELTA_CHUNK
    source = "".join(p.read_text() for p in Path(vexact_models.__file__).parent.rglob("*.py"))
    assert all(f'"{field}"' in source for field in VEXACT_CONFIG_FIELDS)  # each one is read by a model


def test_parse_overrides_reads_json_values_and_refuses_malformed_items():
    from vexact_models.conformance.models import parse_overrides

    assert parse_overrides(["n_routed_experts=64", "q_lora_rank=null", "mla_kv_cache=latent", "x=[1, 2]"]) == {
        "n_routed_experts": 64, "q_lora_rank": None, "mla_kv_cache": "latent", "x": [1, 2]}
    assert parse_overrides(None) == {}
    for bad in ("novalue", "=3"):
        with pytest.raises(ValueError, match="expected KEY=VALUE"):
            parse_overrides([bad])


def test_select_scenarios_keeps_the_named_ones_in_order():
    names = scenario_names(32)
    assert [sc["name"] for sc in select_scenarios(32)] == names
    picked = [sc["name"] for sc in select_scenarios(32, ["preemption", "chunk 128"])]
    assert picked == ["batch 32, chunk 128", "batch 32, preemption"]
    with pytest.raises(ValueError, match=r"'chunk 99' matches none .*'batch 32, chunk 128'"):
        select_scenarios(32, ["chunk 128", "chunk 99"])


def test_grad_sample_count_bounds_the_autograd_recompute():
    from vexact_models.conformance.recompute import GRAD_SAMPLES, GRAD_TOKENS, grad_sample_count

    short = [([1] * 10, [2] * 5)] * 20
    assert grad_sample_count(short) == GRAD_SAMPLES
    long = [([1] * (GRAD_TOKENS // 3), [2] * 100)] * 8
    assert grad_sample_count(long) == 2  # a third would pass GRAD_TOKENS
    assert grad_sample_count([([1] * GRAD_TOKENS * 2, [2])] * 3) == 1  # the first always
    assert grad_sample_count([]) == 0


def test_recompute_groups_split_the_recompute_into_bounded_forwards():
    """`recompute_groups`: consecutive runs of at most the budget's tokens, every sample once, in
    order; a sample past the budget alone."""
    from vexact_models.conformance.recompute import recompute_groups

    samples = [([1] * 30, [2] * 10), ([1] * 50, [2] * 20), ([1] * 5, [2] * 5), ([1] * 200, [2]), ([1] * 3, [2])]
    assert recompute_groups(samples, 100) == [range(0, 1), range(1, 3), range(3, 4), range(4, 5)]
    assert recompute_groups(samples, 10_000) == [range(0, 5)]
    assert recompute_groups([], 100) == []


def test_module_bytes_counts_each_storage_once():
    """`suite._module_bytes` (the parameters' and buffers' share of what a freed engine leaves,
    printed under ``--progress``): a tied weight and views of one buffer count once, buffers count."""
    from vexact_models.conformance import suite

    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False))
    model[1].weight = model[0].weight  # tied: one storage
    model.register_buffer("table", torch.zeros(3, 5, dtype=torch.float64))
    assert suite._module_bytes(model) == 10 * 4 * 4 + 3 * 5 * 8
    shared = torch.zeros(20, 4)
    model[0].weight.data = shared[:10]
    model.register_buffer("rest", shared[10:])  # a view of the same storage
    assert suite._module_bytes(model) == 20 * 4 * 4 + 3 * 5 * 8
