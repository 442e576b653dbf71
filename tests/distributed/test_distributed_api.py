"""vexact_models.distributed without a process group: argument checks (raised before anything
changes) and weight streaming from an unsharded model; `exit_rank` in a one-rank gloo process."""

import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy

import vexact_models.qwen3 as qwen3
from vexact_models.distributed import (LAUNCHER_WORLD_SIZE_VARS, checkpoint_name, exit_rank, launcher_world_size, shard,
                                       stream_full_weights)


@pytest.fixture
def model():
    return qwen3.Qwen3ForCausalLM(qwen3.tiny_config())


@pytest.mark.parametrize("kwargs, words", [
    ({"mp_policy": MixedPrecisionPolicy(), "param_dtype": torch.bfloat16}, ["mp_policy", "param_dtype", "not both"]),
    ({"param_dtype": torch.int32}, ["param_dtype=torch.int32", "floating-point"]),
    ({"reduce_dtype": "fp32"}, ["reduce_dtype='fp32'"]),
    ({"mp_policy": "bf16"}, ["mp_policy='bf16'", "MixedPrecisionPolicy"]),
    ({"offload": "yes"}, ["offload='yes'", "bool"]),
    ({"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, output_dtype=torch.bfloat16)},
     ["output_dtype=torch.bfloat16", "leave it None"]),
])
def test_shard_rejects_bad_arguments_before_changing_anything(model, kwargs, words):
    with pytest.raises(ValueError) as info:
        shard(model, activation_checkpointing=True, **kwargs)
    assert all(w in str(info.value) for w in words), str(info.value)
    assert not isinstance(model, FSDPModule) and not model.model.gradient_checkpointing


def test_shard_needs_decoder_layers():
    with pytest.raises(ValueError, match="Linear has no decoder layers"):
        shard(nn.Linear(2, 2))


def test_shard_without_a_process_group_says_how_to_start_one(model):
    assert not torch.distributed.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        shard(model, activation_checkpointing=True)
    assert not isinstance(model, FSDPModule) and not model.model.gradient_checkpointing


@pytest.mark.parametrize("kwargs, words", [
    ({"bucket_bytes": 0}, ["bucket_bytes=0", ">= 1"]),
    ({"bucket_bytes": 1.5}, ["bucket_bytes=1.5"]),
    ({"dtype": "bf16"}, ["dtype='bf16'"]),
])
def test_stream_full_weights_rejects_bad_arguments(model, kwargs, words):
    with pytest.raises(ValueError) as info:
        stream_full_weights(model, **kwargs)
    assert all(w in str(info.value) for w in words), str(info.value)


def test_stream_full_weights_of_an_unsharded_model_is_its_parameters(model):
    got = list(stream_full_weights(model, dtype=torch.bfloat16))
    want = list(model.named_parameters())
    assert [n for n, _ in got] == [n for n, _ in want]
    assert "lm_head.weight" not in dict(got)  # tied: once, under the embedding's name
    assert all(g.dtype == torch.bfloat16 and torch.equal(g, w.detach().to(torch.bfloat16))
               for (_, g), (_, w) in zip(got, want))


def test_checkpoint_name_strips_wrapper_prefixes():
    assert checkpoint_name("model.layers.0._checkpoint_wrapped_module.mlp.up_proj.weight") == \
        "model.layers.0.mlp.up_proj.weight"
    assert checkpoint_name("_orig_mod.model.norm.weight") == "model.norm.weight"


@pytest.mark.parametrize("code", [256, -1, True, "0", None])
def test_exit_rank_refuses_a_code_that_is_not_an_exit_status(code):
    with pytest.raises(ValueError) as info:
        exit_rank(code)
    assert f"got {code!r}" in str(info.value) and "0..255" in str(info.value)


def test_launcher_world_size_reads_torchrun_then_mpi(monkeypatch):
    for name in LAUNCHER_WORLD_SIZE_VARS:
        monkeypatch.delenv(name, raising=False)
    assert launcher_world_size() is None  # a plain `python script.py`
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "4")
    assert launcher_world_size() == 4
    monkeypatch.setenv("WORLD_SIZE", "2")  # torchrun's wins, as in accelerate
    assert launcher_world_size() == 2
    for bad in ("0", "two", ""):
        monkeypatch.setenv("WORLD_SIZE", bad)
        with pytest.raises(ValueError, match=f"WORLD_SIZE={bad!r} must be a positive integer"):
            launcher_world_size()


RANK_THAT_EXITS = textwrap.dedent("""
    import atexit, sys
    import torch, torch.distributed as dist
    import vexact_models.qwen3 as qwen3
    from vexact_models.distributed import exit_rank, shard

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    model = qwen3.Qwen3ForCausalLM(qwen3.tiny_config())
    shard(model)
    model.token_logprobs(torch.tensor([[1, 2, 3]]))
    atexit.register(lambda: print("teardown ran"))
    print("rank done", end="")  # no newline, no flush: exit_rank must flush it
    exit_rank(3)
""")


def test_exit_rank_flushes_and_exits_with_the_code_without_teardown():
    """After FSDP2 on gloo (whose group outlives destroy_process_group), the rank ends with its
    own status and its output, and the interpreter's teardown (atexit) does not run."""
    run = subprocess.run([sys.executable, "-c", RANK_THAT_EXITS], capture_output=True, text=True, timeout=120)
    assert run.returncode == 3, run.stderr[-3000:]
    assert run.stdout == "rank done", run.stdout
