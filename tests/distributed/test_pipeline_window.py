"""The window page group on pipeline stages (docs/design.md section 6, docs/pipeline.md), on CPU
(gloo, torchrun, 2 ranks): tiny Gemma 3 (stage 0 holds windowed layers only, stage 1 the full
one) and GPT-OSS (stage 0 mixed, stage 1 windowed only), windows of 8 keys under prompts of
30-90 tokens. Each stage prices each group's page at its own layers' bytes and all agree on both
page counts; each holds its windowed layers' pages in the window group's pool; the first stage's
free lists account for every page while window pages are freed mid-sequence; tokens and logprobs
== the pipeline keeping every page == a single-process engine == `token_logprobs`, bitwise, chunked
(64 and 7) and under preemption. And a model whose every layer is windowed (Llama with a window
of 6, as Mistral): every stage takes the window and the first frees pages behind it, bitwise
likewise. The launch is tests/distributed/pipeline_window_worker.py."""

import pytest
import torch

from vexact_models.registry import architectures

from .fsdp_support import failures, torchrun

NAMES = [a.name for a in architectures() if a.name in ("gemma3", "gpt_oss")]
if not NAMES:  # Architecture.min_transformers keeps them out on older releases
    pytest.skip("GPT-OSS and Gemma 3 need a newer transformers", allow_module_level=True)
SCENARIOS = ("budget 64", "chunk 7", "preempting")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("pipeline_window")
    results = torchrun("pipeline_window_worker.py", 2, out, "--archs", ",".join(NAMES), timeout=900)
    assert sorted(results) == [0, 1]
    crashed = {r: c["crash"]["detail"] for r, c in results.items() if "crash" in c}
    assert not crashed, crashed
    return results


def _assert_ok(results, prefix):
    bad = failures(results, prefix)
    assert not bad, "\n".join(bad[:20])


def test_each_stage_prices_its_own_layers_and_all_agree_on_both_page_counts(results):
    _assert_ok(results, "pages/")
    for name in NAMES:
        for scenario in SCENARIOS:
            for check in ("counts", "caches", "bytes_per_sequence"):
                assert all(results[r][f"pages/{name}/{scenario}/{check}"]["ok"] for r in (0, 1)), (name, scenario)
            key = f"pages/{name}/{scenario}/config"
            assert results[0][key]["detail"] == results[1][key]["detail"], key


def test_first_stage_free_lists_account_for_both_groups_while_window_pages_are_freed(results):
    for name in NAMES:
        for scenario in SCENARIOS:
            for check in ("free_lists_account", "window_pages_released"):
                assert results[0][f"rollout/{name}/{scenario}/{check}"]["ok"], results[0][f"rollout/{name}/{scenario}/{check}"]


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_a_model_windowed_in_every_layer_frees_pages_on_stages_bitwise(results, scenario):
    """Mistral's case (every layer windowed: `cache_window`, no page group) on two stages: the
    window on both, pages released behind it on the first, bitwise the pipeline keeping every page
    (which preempts in the tight scenario), one process and the recompute."""
    tag = f"all_windowed/{scenario}"
    assert all(results[r][f"{tag}/kv_window"]["ok"] for r in (0, 1))
    assert results[0][f"{tag}/outputs"]["detail"] == results[1][f"{tag}/outputs"]["detail"]
    checks = ["pages_released", "equals_pipeline_keeping_pages", "equals_single_process", "equals_recompute"]
    for check in checks + (["preempted"] if scenario == "preempting" else []):
        assert results[0][f"{tag}/{check}"]["ok"], results[0][f"{tag}/{check}"]


def test_pipelined_window_group_equals_one_group_single_process_and_recompute_bitwise(results):
    _assert_ok(results, "rollout/")
    for name in NAMES:
        for scenario in SCENARIOS:
            for check in ("equals_pipeline_one_group", "equals_single_process", "equals_recompute"):
                assert results[0][f"rollout/{name}/{scenario}/{check}"]["ok"]
        assert results[0][f"rollout/{name}/preempting/preempted"]["ok"]
        assert results[0][f"rollout/{name}/budget 64/window_pages_shared"]["ok"]
        for scenario in SCENARIOS:
            key = f"rollout/{name}/{scenario}/outputs"
            assert results[0][key]["detail"] == results[1][key]["detail"], f"{key}: ranks differ"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (Triton kernels, CUDA graphs)")
def test_pipelined_window_group_on_gpus_with_decode_graphs(tmp_path):
    """The same checks on the GPU (one per rank when two are visible, else both ranks on one; the
    carries through host memory over gloo), in bf16 at head dim 64, every engine with its decode
    CUDA graphs: each stage's graphs stage the window group's slots and tables from the plan."""
    results = torchrun("pipeline_window_worker.py", 2, tmp_path, "--archs", ",".join(NAMES), "--device", "cuda",
                       timeout=900, cuda=True)
    assert sorted(results) == [0, 1]
    crashed = {r: c["crash"]["detail"] for r, c in results.items() if "crash" in c}
    assert not crashed, crashed
    for prefix in ("pages/", "rollout/"):
        _assert_ok(results, prefix)
    for name in NAMES:
        for scenario in SCENARIOS:
            assert all(results[r][f"pages/{name}/{scenario}/decode_graphs"]["ok"] for r in (0, 1))
            for check in ("equals_pipeline_one_group", "equals_single_process", "equals_recompute",
                          "free_lists_account", "window_pages_released"):
                assert results[0][f"rollout/{name}/{scenario}/{check}"]["ok"], (name, scenario, check)
            key = f"rollout/{name}/{scenario}/outputs"
            assert results[0][key]["detail"] == results[1][key]["detail"], f"{key}: ranks differ"
