"""LLM's constructor: every bad argument or model is a ValueError naming the argument, the value
and the limit, raised before the engine changes the model it was handed; and the engine runs the
kernel backend the user chose (set_backend / use_backend / VEXACT_BACKEND)."""

import os
import subprocess
import sys

import pytest
import torch
import transformers

import vexact_models.qwen3 as qwen3
from vexact_models.kernels import UnsupportedError, set_backend, use_backend
from vexact_models.runtime import LLM, SamplingParams
from vexact_models.runtime.llm_setup import pick_device

from .llm_support import gen, make_llm, training_logprobs

GREEDY = SamplingParams(temperature=0.0, max_tokens=3)
PROMPT = [5, 6, 7, 8]


def fresh_model():
    torch.manual_seed(0)
    return qwen3.Qwen3ForCausalLM(qwen3.tiny_config(initializer_range=0.5)).eval()


def storage(model) -> dict[str, int]:
    """Where each parameter's data lives: the engine's projection fusion moves q/k/v and gate/up."""
    return {name: p.data_ptr() for name, p in model.named_parameters()}


@pytest.mark.parametrize("kwargs, words", [
    (dict(block_size=0), ["block_size=0", "minimum 1"]),              # was ZeroDivisionError
    (dict(block_size=-1), ["block_size=-1", "minimum 1"]),            # was "(-512 bytes)"
    (dict(block_size=2.5), ["block_size=2.5", "int"]),
    (dict(max_num_seqs=0), ["max_num_seqs=0", "minimum 1"]),
    (dict(max_num_seqs=-2), ["max_num_seqs=-2", "minimum 1"]),
    (dict(max_num_batched_tokens=0), ["max_num_batched_tokens=0", "minimum 1"]),
    (dict(cuda_graph_max_tokens=-1), ["cuda_graph_max_tokens=-1", "minimum 0"]),
    (dict(cuda_graph_max_tokens=1.5), ["cuda_graph_max_tokens=1.5", "int"]),
    (dict(cuda_graph_sizes=[]), ["cuda_graph_sizes=[]", "non-empty list"]),
    (dict(cuda_graph_sizes="8"), ["cuda_graph_sizes='8'", "non-empty list"]),
    (dict(cuda_graph_sizes=[8, 0]), ["cuda_graph_sizes entry=0", "minimum 1"]),
    (dict(kv_cache_bytes=0), ["kv_cache_bytes=0", "minimum 1"]),
    (dict(kv_cache_bytes=-5), ["kv_cache_bytes=-5", "minimum 1"]),
    (dict(kv_cache_bytes=10), ["(10 bytes)", "one block", "kv_cache_bytes"]),
    (dict(max_model_len=0), ["max_model_len=0", "minimum 1"]),
    (dict(max_model_len=2000), ["max_model_len=2000", "max_position_embeddings=1024"]),
    (dict(gpu_memory_utilization=0.0), ["gpu_memory_utilization=0.0", "(0, 1]"]),
    (dict(gpu_memory_utilization=float("nan")), ["gpu_memory_utilization=nan", "(0, 1]"]),
    (dict(seed=-1), ["seed=-1", "minimum 0"]),
    (dict(seed=2**63), [f"seed={2**63}", "below"]),
    (dict(enforce_eager="no"), ["enforce_eager='no'", "bool"]),
    (dict(dtype="float99"), ["dtype='float99'", "bfloat16"]),
    (dict(dtype=torch.bfloat16), ["dtype=torch.bfloat16", "torch.float32"]),   # an instance keeps its dtype
    (dict(device="gpu"), ["device='gpu'"]),
    (dict(aligned=False), ["aligned=False", "CUDA"]),
    (dict(enable_chunked_prefill=False, max_num_batched_tokens=8, max_model_len=16), ["max_num_batched_tokens=8"]),
])
def test_bad_arguments_raise_before_the_model_changes(kwargs, words):
    model = fresh_model()
    before = storage(model)
    with pytest.raises(ValueError) as info:
        make_llm(model, **kwargs)
    for word in words:
        assert word in str(info.value), (word, str(info.value))
    assert storage(model) == before  # nothing fused, nothing moved


@pytest.mark.parametrize("eos", [512, [1, 600], -1])
def test_eos_outside_the_vocabulary_is_a_clear_error(eos):
    """was an IndexError inside the sampler's first step"""
    torch.manual_seed(0)
    model = qwen3.Qwen3ForCausalLM(qwen3.tiny_config(initializer_range=0.5, eos_token_id=eos)).eval()
    model.generation_config.eos_token_id = eos
    before = storage(model)
    with pytest.raises(ValueError, match=r"eos_token_id .* outside the vocabulary \[0, 512\)"):
        make_llm(model)
    assert storage(model) == before


def test_a_good_engine_does_fuse_the_model():
    # the check above can fail: a successful construction moves the fused projections
    model = fresh_model()
    before = storage(model)
    make_llm(model)
    assert storage(model) != before


def test_stock_transformers_model_is_a_clear_error():
    torch.manual_seed(0)
    stock = transformers.Qwen3ForCausalLM(qwen3.tiny_config()).eval()   # was AttributeError kv_cache_spec
    with pytest.raises(ValueError) as info:
        LLM(stock, kv_cache_bytes=1 << 20)
    message = str(info.value)
    for word in ["stock", "transformers.models.qwen3", "vexact_models.patch()", "vexact_models.qwen3.Qwen3ForCausalLM"]:
        assert word in message, (word, message)


def test_base_model_and_non_models_are_clear_errors():
    base = qwen3.Qwen3Model(qwen3.tiny_config())
    with pytest.raises(ValueError, match="base model .*Qwen3Model.*no lm_head"):
        LLM(base, kv_cache_bytes=1 << 20)
    with pytest.raises(ValueError, match="model must be a checkpoint folder .* got a int"):
        LLM(123, kv_cache_bytes=1 << 20)
    with pytest.raises(ValueError, match="Linear without an HF config"):
        LLM(torch.nn.Linear(2, 2), kv_cache_bytes=1 << 20)
    mistral = transformers.MistralForCausalLM(transformers.MistralConfig(  # an architecture we do not serve
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1))
    with pytest.raises(ValueError, match="model_type 'mistral' is not supported; supported: .*'qwen3'"):
        LLM(mistral, kv_cache_bytes=1 << 20)


# -- the backend the engine runs -----------------------------------------------------------------
# On CPU the 'triton' backend without Triton's interpreter fails in the kernel's own backend
# check (`kernels.backend.select`): a real, observable difference between backends, seen by the
# engine's kernels themselves. Before the fix the engine reset every choice but VEXACT_BACKEND.

@pytest.fixture
def no_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("VEXACT_BACKEND", raising=False)


def test_engine_runs_the_backend_chosen_by_set_backend_and_use_backend(model, no_interpreter):
    llm = make_llm(model)
    assert llm.backend == "reference"
    expected = gen(llm, [PROMPT], GREEDY)[0].outputs[0]
    with use_backend("triton"):
        assert llm.backend == "triton"
        with pytest.raises(UnsupportedError, match="backend 'triton' needs a CUDA tensor"):
            gen(llm, [PROMPT], GREEDY)
    set_backend("triton")
    try:
        with pytest.raises(UnsupportedError, match="backend 'triton' needs a CUDA tensor"):
            gen(llm, [PROMPT], GREEDY)
    finally:
        set_backend(None)
    # the failed calls left nothing behind; back on the default backend the numbers are the same
    assert gen(llm, [PROMPT], GREEDY)[0].outputs[0].logprobs == expected.logprobs


def test_use_backend_overrides_the_environment_for_the_engine_too(model, no_interpreter, monkeypatch):
    monkeypatch.setenv("VEXACT_BACKEND", "triton")
    with use_backend("reference"):
        llm = make_llm(model)
        out = gen(llm, [PROMPT], SamplingParams(temperature=0.8, max_tokens=4, seed=3))[0].outputs[0]
        recomputed = training_logprobs(model, PROMPT, out.token_ids, 0.8)
    assert torch.equal(recomputed, torch.tensor(out.logprobs))
    assert llm.backend == "triton"  # outside the context the environment's choice is back
    with pytest.raises(UnsupportedError, match="backend 'triton'"):
        gen(llm, [PROMPT], GREEDY)


_INTERPRETED = """
import torch
import vexact_models.qwen3 as qwen3
from vexact_models.runtime import LLM, SamplingParams
from vexact_models.runtime.llm_setup import pick_device
from vexact_models.kernels import use_backend

torch.manual_seed(0)
config = qwen3.tiny_config(initializer_range=0.5, num_hidden_layers=1, hidden_size=64, num_attention_heads=2,
                           num_key_value_heads=1, head_dim=64)  # a head dim the Triton attention takes
llm = LLM(qwen3.Qwen3ForCausalLM(config).eval(), device="cpu", kv_cache_bytes=1 << 20, block_size=4)
params = SamplingParams(temperature=0.0, max_tokens=2)
run = lambda: llm.generate([[5, 6, 7, 8]], params, use_tqdm=False)[0].outputs[0].logprobs
reference = run()
with use_backend("triton"):
    interpreted = run()
print(reference == run(), reference != interpreted, max(abs(a - b) for a, b in zip(reference, interpreted)) < 1e-4)
"""


def test_engine_runs_the_triton_kernels_under_use_backend():
    """The positive side, with real numbers: under Triton's CPU interpreter (which tiles through
    BLAS, so its logprobs differ from the reference's in the last bits) ``use_backend("triton")``
    changes what the engine computes, and leaving the context restores the reference numbers."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    env.pop("VEXACT_BACKEND", None)
    proc = subprocess.run([sys.executable, "-c", _INTERPRETED], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["True", "True", "True"], proc.stdout


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (decode CUDA graphs)")
def test_decode_graphs_are_recaptured_when_the_backend_changes():
    """On CUDA the engine replays decode graphs captured at construction: a later backend choice
    must recapture them, and coming back must give the first numbers again (graphs on == off)."""
    torch.manual_seed(0)
    config = qwen3.tiny_config(initializer_range=0.5, hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
                               head_dim=64)  # a head dim the Triton attention takes
    model = qwen3.Qwen3ForCausalLM(config).to("cuda", torch.bfloat16).eval()
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    params = SamplingParams(temperature=1.0, max_tokens=6, seed=1, ignore_eos=True)
    llm = LLM(model, block_size=16, max_num_seqs=4, kv_cache_bytes=1 << 24)
    run = lambda engine: [o.outputs[0].logprobs for o in gen(engine, prompts, params)]  # noqa: E731
    first, graphs = run(llm), llm.runner.graphs
    assert graphs is not None and llm.backend == "triton"
    with use_backend("fast"):
        assert llm.backend == "fast"
        run(llm)
        assert llm.runner.graphs is not graphs  # captured again, under 'fast'
    assert run(llm) == first
    assert run(LLM(model, block_size=16, max_num_seqs=4, kv_cache_bytes=1 << 24, enforce_eager=True)) == first


def test_cuda_graph_token_cap_defaults_to_the_budget_up_to_2048():
    """Steps with prompt chunks replay graphs up to ``min(max_num_batched_tokens, 2048)`` tokens by
    default; ``cuda_graph_max_tokens`` sets the cap (0: decode steps only). Off CUDA nothing is
    captured."""
    model = fresh_model()
    assert make_llm(model).engine_config.cuda_graph_tokens == 64
    assert make_llm(model, max_num_batched_tokens=4096).engine_config.cuda_graph_tokens == 2048
    llm = make_llm(model, max_num_batched_tokens=4096, cuda_graph_max_tokens=3000)
    assert llm.engine_config.cuda_graph_tokens == 3000 and llm.runner.graphs is None
    assert make_llm(model, cuda_graph_max_tokens=0).engine_config.cuda_graph_tokens == 0


def test_cuda_graph_sizes_reach_the_runner():
    """``cuda_graph_sizes`` (vLLM's): the decode batch sizes captured below ``max_num_seqs``,
    `DEFAULT_BUCKETS` when not given."""
    from vexact_models.runtime.cuda_graphs import DEFAULT_BUCKETS

    model = fresh_model()
    assert make_llm(model).runner.cuda_graph_sizes == DEFAULT_BUCKETS
    llm = make_llm(model, cuda_graph_sizes=[4, 16])
    assert llm.engine_config.cuda_graph_sizes == llm.runner.cuda_graph_sizes == (4, 16)


@pytest.mark.parametrize("device", [None, "cuda", torch.device("cuda")])
def test_the_engines_cuda_device_carries_the_current_devices_index(monkeypatch, device):
    """"cuda" (given, or chosen for a checkpoint folder) becomes the current device with its index:
    the engine's other threads set it (``torch.cuda.set_device`` refuses "cuda" alone) and do not
    inherit the builder's current device. A given index and a CPU stay as they are."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    assert pick_device("folder", device, None) == torch.device("cuda", 2)
    assert pick_device("folder", torch.device("cuda", 1), None) == torch.device("cuda", 1)
    assert pick_device("folder", torch.device("cpu"), None) == torch.device("cpu")
    assert pick_device(fresh_model(), None, None) == torch.device("cpu")  # where a model instance's layers are
