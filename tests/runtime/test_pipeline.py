"""Pipeline parallelism's single-process parts (tests/distributed/test_pipeline.py runs the
stages as processes): the layer partition, which tensors a stage owns, `pipeline_parallel_size`
validation (ValueError naming it, before the model changes), stage loading from a checkpoint
folder (only the stage's tensors, the values and dtypes ``from_pretrained`` gives, sharded and
per-expert layouts, named errors), and the stages' forwards chained in one process == the
whole model's forward, bitwise."""

import pytest
import torch

import vexact_models.qwen3 as qwen3
from vexact_models.layers import _fused_weight
from vexact_models.registry import architectures, get
from vexact_models.runtime import LLM, EngineConfig
from vexact_models.runtime.pipeline import PipelineStage, StageModel, partition_layers
from vexact_models.runtime.pipeline_load import load_stage_model
from vexact_models.runtime.step_inputs import build_step_inputs

from ..models.model_support import skip_without_rollout
from .llm_support import cache_bytes


def stages(num_layers: int, size: int) -> list[PipelineStage]:
    return [PipelineStage(s, size, r, num_layers) for s, r in enumerate(partition_layers(num_layers, size))]


@pytest.mark.parametrize("layers, size, want", [
    (2, 2, [(0, 1), (1, 2)]), (3, 2, [(0, 2), (2, 3)]), (7, 3, [(0, 3), (3, 5), (5, 7)]), (4, 1, [(0, 4)]),
    (94, 8, [(0, 12), (12, 24), (24, 36), (36, 48), (48, 60), (60, 72), (72, 83), (83, 94)]),
])
def test_partition_is_contiguous_and_balanced(layers, size, want):
    assert [(r.start, r.stop) for r in partition_layers(layers, size)] == want


@pytest.mark.parametrize("layers, size", [(2, 3), (4, 0)])
def test_partition_rejects_more_stages_than_layers(layers, size):
    with pytest.raises(ValueError, match=f"size={size} is outside"):
        partition_layers(layers, size)


def test_stage_owns_its_layers_the_embeddings_first_and_the_head_last():
    first, middle, last = stages(3, 3)
    for name, owner in [("model.embed_tokens.weight", first), ("model.layers.0.mlp.up_proj.weight", first),
                        ("model.layers.1.self_attn.q_proj.weight", middle), ("model.layers.2.input_layernorm.weight", last),
                        ("model.norm.weight", last), ("lm_head.weight", last)]:
        assert [s.owns(name) for s in (first, middle, last)] == [s is owner for s in (first, middle, last)], name


# -- validation -----------------------------------------------------------------------------------

def fresh_model():
    torch.manual_seed(0)
    return qwen3.Qwen3ForCausalLM(qwen3.tiny_config(initializer_range=0.5)).eval()


@pytest.mark.parametrize("size, words", [
    (0, ["pipeline_parallel_size=0", "minimum 1"]),
    (-1, ["pipeline_parallel_size=-1", "minimum 1"]),
    (True, ["pipeline_parallel_size=True", "int"]),
    (2.0, ["pipeline_parallel_size=2.0", "int"]),
    (3, ["pipeline_parallel_size=3", "num_hidden_layers=2"]),
    (2, ["pipeline_parallel_size=2", "torch.distributed", "torchrun", "no process group"]),
])
def test_bad_pipeline_parallel_size_raises_before_the_model_changes(size, words):
    model = fresh_model()
    before = {n: p.data_ptr() for n, p in model.named_parameters()}
    with pytest.raises(ValueError) as info:
        LLM(model, device="cpu", kv_cache_bytes=cache_bytes(model, 64), pipeline_parallel_size=size)
    assert all(w in str(info.value) for w in words), str(info.value)
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == before  # nothing fused
    attn = model.model.layers[0].self_attn
    assert _fused_weight([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]) is None


def test_pipeline_parallel_size_1_is_the_single_process_engine(model):
    llm = LLM(model, device="cpu", kv_cache_bytes=cache_bytes(model, 64), pipeline_parallel_size=1)
    assert llm.pipeline_stage is None and llm.pipeline is None
    assert all(kv is not None for kv in llm.runner.kv_caches)


# -- loading a stage ------------------------------------------------------------------------------

def saved(arch, tmp_path, **save_kwargs):
    torch.manual_seed(0)
    model = arch.causal_lm_class(arch.tiny_config(initializer_range=0.3))
    if arch.init_for_conformance is not None:
        arch.init_for_conformance(model, 0)
    folder = tmp_path / arch.name
    model.save_pretrained(folder, **save_kwargs)
    return folder


@pytest.mark.parametrize("arch", architectures(), ids=lambda a: a.name)
def test_a_stage_loads_exactly_its_tensors_as_from_pretrained_does(arch, tmp_path):
    """fp32 and bf16 (DeepSeek-V3 keeps its expert-selection bias in fp32 as from_pretrained
    does), single-file and sharded (index.json) checkpoints, per-expert MoE layouts."""
    folder = saved(arch, tmp_path, max_shard_size="40KB")
    assert (folder / "model.safetensors.index.json").is_file()
    for dtype in (torch.float32, torch.bfloat16):
        full = arch.causal_lm_class.from_pretrained(folder, dtype=dtype)
        want = dict(full.state_dict())
        config = full.config
        for stage in stages(config.num_hidden_layers, 2):
            model = load_stage_model(str(folder), arch, config, dtype, stage, torch.device("cpu"))
            got = model.state_dict()
            assert got.keys() == want.keys()
            tied = model.lm_head.weight is model.model.embed_tokens.weight
            for name, tensor in got.items():
                held = stage.owns(name) or (stage.is_last and tied and name == "model.embed_tokens.weight")
                assert tensor.is_meta != held, (stage, name)
                if held:
                    assert tensor.dtype == want[name].dtype and torch.equal(tensor, want[name]), (stage, name)


def test_a_missing_stage_tensor_is_an_error_naming_it(tmp_path):
    from safetensors.torch import load_file, save_file

    arch = get("qwen3")
    folder = saved(arch, tmp_path)
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    config = arch.causal_lm_class.config_class.from_pretrained(folder)
    first, last = stages(2, 2)
    load_stage_model(str(folder), arch, config, torch.float32, first, torch.device("cpu"))  # not its tensor
    with pytest.raises(ValueError, match=r"missing tensor\(s\) \['model\.layers\.1\.mlp\.up_proj\.weight'\]"):
        load_stage_model(str(folder), arch, config, torch.float32, last, torch.device("cpu"))


# -- the stages' forwards, chained in one process -----------------------------------------------------

@pytest.mark.parametrize("arch", architectures(), ids=lambda a: a.name)
def test_stage_forwards_chained_equal_the_whole_forward_bitwise(arch):
    """Three steps (prefill, decode, a chunk mixing both) through stage runners that each hold
    only their layers' KV pages (and gated-DeltaNet states), handing (hidden, residual) on, ==
    one runner over all layers."""
    from vexact_models.runtime.sequence import Sequence
    from vexact_models.runtime.sampling_params import SamplingParams

    skip_without_rollout(arch, "pipeline_parallel")
    torch.manual_seed(0)
    model = arch.inference_class(arch.causal_lm_class(arch.tiny_config(initializer_range=0.3)).eval())
    layers = model.config.num_hidden_layers
    config = EngineConfig(num_blocks=16, block_size=4, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    scheduler = config.make_scheduler()
    cpu = torch.device("cpu")
    whole = config.make_runner(model, cpu, torch.float32, scheduler)
    parts = [config.make_runner(StageModel(model, s), cpu, torch.float32, scheduler, layers=s.layers,
                                carry_width=0 if s.is_first else model.config.hidden_size)
             for s in stages(layers, min(3, layers))]
    gdn = set(whole.linear_spec.layers) if whole.linear_spec is not None else set()  # the hybrids' states, no pages
    assert [[i for i, kv in enumerate(r.kv_caches) if kv is not None] for r in parts] == \
        [[i for i in r if i not in gdn] for r in partition_layers(layers, len(parts))]
    assert [[] if r.linear_states is None else list(r.linear_states.conv) for r in parts] == \
        [[i for i in r if i in gdn] for r in partition_layers(layers, len(parts))]
    for i, prompt in enumerate(([5, 6, 7, 8, 9], [40, 41, 42])):
        scheduler.add(Sequence(i, 0, prompt, SamplingParams(max_tokens=3), seed=i))
    for token in (11, 12, 13):
        step = scheduler.schedule()
        inputs = build_step_inputs(step.scheduled, 4, scheduler.block_manager.tables)
        want = whole.run(inputs)
        carry = None
        for runner in parts:
            carry = runner.run(inputs, carry)
        assert torch.equal(carry, want)
        scheduler.postprocess(step.scheduled, [token] * len(step.scheduled), [0.0] * len(step.scheduled))


def test_engine_config_wires_a_fresh_scheduler_and_a_connected_runner(model):
    config = EngineConfig(num_blocks=8, block_size=4, max_num_seqs=3, max_num_batched_tokens=32, max_model_len=32,
                          eos_token_id=1, enable_chunked_prefill=False, enable_prefix_sharing=False)
    scheduler = config.make_scheduler()
    bm = scheduler.block_manager
    assert (bm.num_blocks, bm.block_size, bm.enable_prefix_sharing) == (8, 4, False)
    assert (scheduler.max_num_seqs, scheduler.max_num_batched_tokens, scheduler.max_model_len, scheduler.eos_token_id,
            scheduler.chunked_prefill) == (3, 32, 32, 1, False)
    again = config.make_scheduler()
    assert again is not scheduler and again.block_manager is not bm
    runner = config.make_runner(get("qwen3").inference_class(model), torch.device("cpu"), torch.float32, scheduler,
                                layers=range(1, 2))
    assert runner.block_tables is bm.tables and runner.num_blocks == 8
    assert runner.kv_caches[0] is None and runner.kv_caches[1] is not None
