"""FSDP2 on CPU (gloo, torchrun): sharded logprobs equal single-process logprobs bitwise for 2
ranks (every architecture) and 4 (one of each kind of layer, `FOUR_RANKS`), every data split, packed and padded input, activation
checkpointing on and off; HF's generate; gradients within fp32 reduction tolerance; mixed
precision; weight streaming; and a full rollout -> recompute -> step -> stream -> rollout iteration on 2 ranks.

Each world size is one torchrun launch (tests/distributed/fsdp_worker.py) whose ranks record
their checks; the tests below assert on groups of them.
"""

import pytest

from vexact_models.registry import architectures

from .fsdp_support import failures, torchrun

CHECKS = {2: "grads,stream,mp,iteration", 4: "grads,stream"}

#: what 4 ranks run: one architecture of each kind of layer (dense GQA, fused experts, MLA with
#: DeepSeekMoE, the gated-DeltaNet hybrid with a shared expert, windows with sinks and biased
#: experts, post-norm), where 2 ranks run every one: the sharding code is the same whatever the
#: layers, and 4 ranks split what these hold other ways than 2 (each one's CPU costs the CI time)
FOUR_RANKS = ("qwen3", "qwen3_moe", "deepseek_v3", "qwen3_5_moe", "gpt_oss", "olmo3")


def archs_of(world: int) -> list:
    """The registered architectures `world` ranks run (on older transformers some are not)."""
    return [arch for arch in architectures() if world == 2 or arch.name in FOUR_RANKS]


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"world{w}")
def run(request, tmp_path_factory):
    world = request.param
    out = tmp_path_factory.mktemp(f"fsdp_world{world}")
    names = ",".join(arch.name for arch in archs_of(world))
    return world, torchrun("fsdp_worker.py", world, out, "--checks", CHECKS[world], "--archs", names)


def _assert_ok(results, prefix):
    bad = failures(results, prefix)
    assert not bad, "\n".join(bad[:20])


def test_every_rank_ran_every_architecture(run):
    world, results = run
    assert sorted(results) == list(range(world))
    for rank, checks in results.items():
        crashed = {n: c["detail"] for n, c in checks.items() if n.startswith("crash/")}
        assert not crashed, f"rank {rank}: {crashed}"
        for arch in archs_of(world):
            assert any(n.startswith(f"logprobs/{arch.name}/") for n in checks), (rank, arch.name)


def test_sharded_logprobs_equal_single_process_bitwise(run):
    """Any split over ranks and micro-batches, packed and left/right padded input,
    activation checkpointing on and off, `shard` and the plain fully_shard recipe."""
    world, results = run
    _assert_ok(results, "logprobs/")
    names = set(results[0])
    for arch in archs_of(world):
        for ckpt in ("no_ckpt", "ckpt"):
            for split in ("round_robin", "uneven_microbatched"):
                for fmt in ("packed", "padded_left", "padded_right"):
                    assert f"logprobs/{arch.name}/{ckpt}/{split}/{fmt}" in names
        assert f"logprobs/{arch.name}/plain_fully_shard" in names


def test_sharded_forward_logits_and_loss_equal_single_process(run):
    _assert_ok(run[1], "forward/")


def test_generate_on_the_sharded_model_equals_single_process(run):
    """HF's ``generate`` on the sharded model, its steps over our KV cache: the unsharded
    model's tokens and logits, every architecture; the engine (``LLM(model)``, and ``generate_batch``,
    which runs one) refused, naming the sharding."""
    world, results = run
    _assert_ok(results, "generate/")
    assert {f"generate/{arch.name}/{check}" for arch in archs_of(world)
            for check in ("sharded_equals_single", "engine_refused")} <= set(results[0])


def test_gradients_equal_single_process_within_fp32_tolerance(run):
    """Only the gradients are reduced across ranks; checkpointing does not change them at all."""
    _assert_ok(run[1], "grads/")


def test_stream_full_weights_gives_the_unsharded_parameters_a_bucket_at_a_time(run):
    _assert_ok(run[1], "stream/")


def test_mixed_precision_bf16_logprobs_equal_the_bf16_model_bitwise(run):
    world, results = run
    if "mp" not in CHECKS[world]:
        pytest.skip("mixed precision is checked on 2 ranks")
    _assert_ok(results, "mp/")


def test_cpu_offload_keeps_the_logprobs(run):
    world, results = run
    if "mp" not in CHECKS[world]:
        pytest.skip("offload is checked on 2 ranks")
    _assert_ok(results, "offload/")


def test_full_iteration_rollout_recompute_step_stream_rollout(run):
    world, results = run
    if "iteration" not in CHECKS[world]:
        pytest.skip("the full iteration runs on 2 ranks")
    _assert_ok(results, "iteration/")
    for arch in archs_of(world):
        assert results[0][f"iteration/{arch.name}/engine_weights_equal_trainer"]["ok"]
        assert results[0][f"iteration/{arch.name}/weights_changed_the_rollout"]["ok"]
