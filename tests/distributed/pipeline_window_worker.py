"""One rank = one pipeline stage of the window-page-group checks (launched by
tests/distributed/test_pipeline_window.py through torchrun, gloo on CPU). For tiny Gemma 3
(windowed layers 0 and 1, full layer 2: stage 0 holds windowed layers only, stage 1 the full one)
and GPT-OSS (windowed 0 and 2, full 1: stage 0 mixed, stage 1 windowed only), windows of 8 keys
under prompts of 30-90 tokens, so that window pages are freed mid-sequence (docs/design.md
section 6, `runtime.page_groups`):

- pages: each stage's budget prices each group's page at its own layers' bytes, and every stage
  takes the same page counts (a stage of windowed layers only whose budget fits the window
  group's cap takes the others' global count; one whose budget does not bounds both); each stage
  holds its windowed layers' K/V in caches of the window group's page count, its full layers' in
  the global group's; `LLM.kv_bytes_per_sequence` counts the windowed layers' pages from their
  window on, as on one process.
- rollout: ``LLM(folder, pipeline_parallel_size=2)`` with the window group rolls out chunked
  (budget 64; chunks of 7) and under preemption; on the first stage, after every schedule, each
  group's free list accounts for exactly the pages the running sequences hold, no sequence holds
  more than `window_pages_bound` window pages, and window pages are released mid-sequence; all
  pages are free after the call. Tokens and logprobs are bitwise those of the pipeline without the
  window group (every page kept), of a single-process ``LLM`` with it and of ``token_logprobs``;
  every rank returns the same outputs.

With ``--device cuda`` (the `gpu` test) every engine runs on the GPU in bf16 at head dim 64 (rank
r on GPU ``r % count``; the carries through host memory over gloo) with its decode CUDA graphs
(each stage's, the window group's static inputs among them), and the recompute on the GPU too.

Ranks never assert: each check is recorded in ``<out>/rank<r>.json``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fsdp_support import make_model, run_rank  # noqa: E402
from pipeline_rollout_worker import flat  # noqa: E402

from vexact_models.distributed import exit_rank  # noqa: E402
from vexact_models.layers import window_layers  # noqa: E402
from vexact_models.registry import get  # noqa: E402
from vexact_models.runtime import LLM, SamplingParams, llm_setup  # noqa: E402
from vexact_models.runtime.llm_setup import kv_bytes_per_sequence  # noqa: E402
from vexact_models.runtime.model_runner import kv_bytes_per_block  # noqa: E402
from vexact_models.runtime.page_groups import PageGroups, window_pages_bound, window_pages_cap  # noqa: E402
from vexact_models.runtime.pipeline import partition_layers  # noqa: E402

BLOCK, SEQS = 4, 8
PROMPTS = [list(range(3, 80)), list(range(100, 190)), list(range(200, 230))]
PARAMS = [SamplingParams(temperature=1.0, n=2, max_tokens=12, seed=1, ignore_eos=True),
          SamplingParams(temperature=0.8, max_tokens=10, seed=2, ignore_eos=True),
          SamplingParams(temperature=1.0, max_tokens=12, seed=3, ignore_eos=True, stop_token_ids=[7, 11])]
#: name -> (engine arguments, global pages, whether only the windowed-only stage's budget is tight)
SCENARIOS = {"budget 64": (dict(max_num_batched_tokens=64), 250, False),
             "chunk 7": (dict(max_num_batched_tokens=7), 250, False),
             "preempting": (dict(max_num_batched_tokens=32), 40, True)}


#: the GPU run's model dimensions (the Triton kernels' head dims; tests/runtime/test_page_groups_engine.py's)
GPU_DIMS = dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=64)


def recompute_matches(model, outputs) -> tuple[bool, str]:
    """Every completion's logprobs == ``token_logprobs`` of prompt + completion at its
    temperature, on the model's device."""
    bad, total = 0, 0
    for out, params in zip(outputs, PARAMS):
        for c in out.outputs:
            with torch.no_grad():
                ids = torch.tensor([out.prompt_token_ids + c.token_ids], device=model.device)
                want = model.token_logprobs(ids, temperature=params.temperature)[0, len(out.prompt_token_ids):]
            total += len(c.token_ids)
            bad += int(not torch.equal(torch.tensor(c.logprobs, device=want.device), want))
    return bad == 0 and total > 0, f"{bad} completions differ, {total} tokens checked"


def stage_budget(model, layers, window: int, tokens: int, pages: int, tight_window_stage: bool,
                 dtype: torch.dtype) -> tuple[int, int, int]:
    """(this stage's ``kv_cache_bytes``, the global pages and window pages every stage should
    take): `pages` global pages, the window group's ``min(pages, cap)``, each at the stage's own
    layers' bytes; a stage of windowed layers only gets one page more than the cap when its budget
    is not the tight one (so it leaves the global count to the others), else exactly `pages`
    (and, `tight_window_stage`, the other stages twice as much: the windowed-only stage bounds both)."""
    spec = model.kv_cache_spec()
    per_layer = kv_bytes_per_block(spec, BLOCK, dtype) // spec[0]
    windowed = set(window_layers(model)[1])
    held_window = sum(1 for i in layers if i in windowed)
    held_global = len(layers) - held_window
    cap = window_pages_cap(window, BLOCK, SEQS, tokens)
    want = min(pages, cap)
    if held_global == 0:
        return per_layer * held_window * (want if tight_window_stage or pages <= cap else cap + 1), pages, want
    scale = 2 if tight_window_stage else 1
    return per_layer * (held_global * pages + held_window * want) * scale, pages, want


def tracked_generate(llm: LLM, chunk: int) -> tuple[list, dict, list[str]]:
    """(outputs, what the tracker saw, accounting errors): after each schedule the first stage's
    free lists account for exactly the pages its running sequences hold, in each group, and no
    sequence holds more than `window_pages_bound` window pages; after the call every page is free."""
    bm, sched = llm.block_manager, llm.scheduler
    seen, errors = dict(held=0, held_window=0, released=0, steps=0), []
    schedule = sched.schedule

    def tracked():
        out = schedule()
        seen["steps"] += 1
        held = {b for s in sched._running for b in s.block_table[s.released_blocks:]}
        if bm.num_blocks - bm.num_free_blocks != len(held):
            errors.append(f"global: {bm.num_blocks - bm.num_free_blocks} pages taken, {len(held)} held")
        seen["held"] += len(held)
        if isinstance(bm, PageGroups):
            group = bm.window_group
            views = [s.window_pages for s in sched._running]
            held = {b for v in views for b in v.block_table[v.released_blocks:]}
            if group.num_blocks - group.num_free_blocks != len(held):
                errors.append(f"window: {group.num_blocks - group.num_free_blocks} pages taken, {len(held)} held")
            for view in views:
                if len(view.block_table) != len(view.seq.block_table):
                    errors.append(f"seq {view.seq_id}: tables of {len(view.block_table)} and {len(view.seq.block_table)}")
                if len(view.block_table) - view.released_blocks > window_pages_bound(group.window, BLOCK, chunk):
                    errors.append(f"seq {view.seq_id}: {len(view.block_table) - view.released_blocks} window pages")
                seen["released"] = max(seen["released"], view.released_blocks)
            seen["held_window"] += len(held)
        return out

    if llm.pipeline_stage is None or llm.pipeline_stage.is_first:
        sched.schedule = tracked
    try:
        outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    finally:
        sched.__dict__.pop("schedule", None)
    if bm.num_free_blocks != bm.num_blocks:
        errors.append(f"global: {bm.num_free_blocks} of {bm.num_blocks} free after the call")
    if isinstance(bm, PageGroups) and bm.window_group.num_free_blocks != bm.window_group.num_blocks:
        errors.append(f"window: {bm.window_group.num_free_blocks} of {bm.window_group.num_blocks} free after the call")
    return outs, seen, errors


def check_pages(res, tag: str, llm: LLM, pages: int, window_pages: int) -> None:
    """Both page counts as the budgets say, and this stage's caches sized by its layers' groups."""
    config, runner = llm.engine_config, llm.runner
    group = config.window_group
    res.record(f"pages/{tag}/counts", group is not None and (config.num_blocks, group.num_blocks) == (pages, window_pages),
               f"(global, window) = ({config.num_blocks}, {None if group is None else group.num_blocks}), "
               f"want ({pages}, {window_pages})")
    if group is None:
        return
    sizes = {i: kv[0].shape[0] for i, kv in enumerate(runner.kv_caches) if kv is not None}
    want = {i: group.num_blocks if i in group.layers else config.num_blocks for i in llm.pipeline_stage.layers}
    res.record(f"pages/{tag}/caches", sizes == want, f"pages per held layer {sizes}, want {want}")
    res.record(f"pages/{tag}/config", True, repr((config.num_blocks, group)))  # compared across ranks
    freed, kept = llm.kv_bytes_per_sequence(100), llm.kv_bytes_per_sequence(100, window_freed=False)
    res.record(f"pages/{tag}/bytes_per_sequence", freed == kv_bytes_per_sequence(
        llm.model, 100, dtype=llm.dtype, block_size=BLOCK) and freed < kept, f"{freed} freed, {kept} kept")


def one_group(path: str, **kwargs) -> LLM:
    """An engine whose windowed layers keep every page (no window group, as before it)."""
    real = llm_setup.window_layers
    llm_setup.window_layers = lambda model: None
    try:
        return LLM(path, **kwargs)
    finally:
        llm_setup.window_layers = real


def run_arch(res, name: str, out: Path, rank: int, world: int, device: str) -> None:
    arch = get(name)
    cuda = device == "cuda"
    base = make_model(arch, **(GPU_DIMS if cuda else {})).eval()
    folder = out / f"ckpt_{name}"
    if rank == 0:
        base.save_pretrained(folder)
    dist.barrier()
    dtype = torch.bfloat16 if cuda else torch.float32
    here = torch.device(f"cuda:{rank % torch.cuda.device_count()}") if cuda else torch.device("cpu")
    base = base.to(here, dtype)
    window, _ = window_layers(base)
    layers = partition_layers(base.config.num_hidden_layers, world)[rank]
    spec = base.kv_cache_spec()
    per_layer = kv_bytes_per_block(spec, BLOCK, dtype) // spec[0]
    for scenario, (kwargs, pages, tight) in SCENARIOS.items():
        tag = f"{name}/{scenario}"
        chunk = kwargs["max_num_batched_tokens"]
        budget, pages, window_pages = stage_budget(base, layers, window, chunk, pages, tight, dtype)
        common = dict(device=here, dtype=dtype, block_size=BLOCK, max_num_seqs=SEQS, **kwargs)
        llm = LLM(str(folder), pipeline_parallel_size=world, kv_cache_bytes=budget, **common)
        if cuda:
            res.record(f"pages/{tag}/decode_graphs", llm.runner.graphs is not None and
                       llm.runner.graphs.window_group == llm.engine_config.window_group, "each stage's decode graphs")
        check_pages(res, tag, llm, pages, window_pages)
        got, seen, errors = tracked_generate(llm, chunk)
        res.record(f"rollout/{tag}/outputs", True, repr(flat(got)))  # compared across ranks
        plain = one_group(str(folder), pipeline_parallel_size=world, kv_cache_bytes=per_layer * len(layers) * pages,
                          **common)
        plain_out, plain_seen, _ = tracked_generate(plain, chunk)
        if rank != 0:
            continue
        res.record(f"rollout/{tag}/free_lists_account", not errors, "; ".join(errors[:4]))
        res.record(f"rollout/{tag}/window_pages_released", seen["released"] >= 16 and
                   seen["held_window"] < plain_seen["held"] and seen["held"] == plain_seen["held"],
                   f"{seen}, one group: {plain_seen}")
        res.record(f"rollout/{tag}/equals_pipeline_one_group", flat(got) == flat(plain_out), f"{len(got)} requests")
        single = LLM(str(folder), kv_cache_bytes=per_layer * (spec[0] * pages), **common)
        want = flat(single.generate(PROMPTS, PARAMS, use_tqdm=False))
        res.record(f"rollout/{tag}/equals_single_process", flat(got) == want, f"{len(want)} completions")
        res.record(f"rollout/{tag}/equals_recompute", *recompute_matches(base, got))
        if tight:
            res.record(f"rollout/{tag}/preempted", llm.num_preemptions > 0, f"{llm.num_preemptions} preemptions")
        else:
            hits = llm.block_manager.window_group.num_shared_hits
            res.record(f"rollout/{tag}/window_pages_shared", hits > 0, f"{hits} window pages shared")


def run_all_windowed(res, out: Path, rank: int, world: int) -> None:
    """A model whose every layer is windowed (tiny Llama with ``sliding_window`` 6, as Mistral):
    every stage's engine takes the window (`cache_window` reads every layer's module, the other
    stages' on meta), the first stage frees the pages behind it mid-sequence, and tokens and
    logprobs equal the pipeline keeping every page (which preempts where pages are tight), a
    single-process engine and ``token_logprobs``, chunked (64 and 7)."""
    arch = get("llama")
    base = make_model(arch, sliding_window=6).eval()
    folder = out / "ckpt_llama_windowed"
    if rank == 0:
        base.save_pretrained(folder)
    dist.barrier()
    spec = base.kv_cache_spec()
    per_layer = kv_bytes_per_block(spec, BLOCK, torch.float32) // spec[0]
    layers = partition_layers(base.config.num_hidden_layers, world)[rank]
    for scenario, (kwargs, pages, tight) in SCENARIOS.items():
        tag = f"all_windowed/{scenario}"
        pages = 30 if tight else pages  # tight: the engine keeping every page preempts
        common = dict(device="cpu", dtype=torch.float32, block_size=BLOCK, max_num_seqs=SEQS,
                      kv_cache_bytes=per_layer * len(layers) * pages, **kwargs)
        llm = LLM(str(folder), pipeline_parallel_size=world, **common)
        res.record(f"{tag}/kv_window", llm.engine_config.kv_window == 6, f"kv_window {llm.engine_config.kv_window}")
        released = 0
        if rank == 0:
            sched = llm.scheduler
            schedule = sched.schedule

            def tracked():
                nonlocal released
                step = schedule()
                released = max([released] + [s.released_blocks for s in sched._running])
                return step
            sched.schedule = tracked
        got = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        keeping = LLM(str(folder), pipeline_parallel_size=world, **common)
        keeping.block_manager.window = None  # every page kept (the first stage schedules)
        kept = keeping.generate(PROMPTS, PARAMS, use_tqdm=False)
        res.record(f"{tag}/outputs", True, repr(flat(got)))  # compared across ranks
        if rank != 0:
            continue
        res.record(f"{tag}/pages_released", released >= 4, f"{released} pages released behind the window")
        res.record(f"{tag}/equals_pipeline_keeping_pages", flat(got) == flat(kept), f"{len(got)} requests")
        single = LLM(str(folder), **dict(common, kv_cache_bytes=per_layer * spec[0] * pages))
        want = flat(single.generate(PROMPTS, PARAMS, use_tqdm=False))
        res.record(f"{tag}/equals_single_process", flat(got) == want, f"{len(want)} completions")
        res.record(f"{tag}/equals_recompute", *recompute_matches(base, got))
        if tight:
            res.record(f"{tag}/preempted", keeping.num_preemptions > 0,
                       f"{keeping.num_preemptions} preemptions keeping every page, {llm.num_preemptions} freeing them")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--archs", required=True, help="comma-separated architecture names")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args()
    def run(res, rank: int, world: int) -> None:
        for name in args.archs.split(","):
            run_arch(res, name, args.out, rank, world, args.device)
        if args.device == "cpu":
            run_all_windowed(res, args.out, rank, world)

    run_rank(run, args.out)


if __name__ == "__main__":
    main()
    exit_rank(0)  # not a plain return: interpreter teardown with gloo threads alive can abort a rank
