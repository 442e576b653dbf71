"""One rank = one pipeline stage of the pipeline-parallel rollout checks (launched by
tests/distributed/test_pipeline.py through torchrun, gloo on CPU). For every architecture
given (tiny configs):

- stage: the engine loaded from a checkpoint folder holds only its stage's tensors (the
  others stay on the meta device), KV pages for its attention layers only and, for the
  gated-DeltaNet hybrids, the states of its own gated-DeltaNet layers only.
- rollout: ``LLM(folder, pipeline_parallel_size=P)`` rolls out a pool of requests (greedy,
  sampled, top-k, top-p, min_tokens with a stop token, n = 3 sharing prompt pages) and every
  rank returns the same outputs, bitwise those of a single-process ``LLM`` over the whole model
  (computed on rank 0) and equal to its ``token_logprobs`` recompute; once with a roomy cache,
  once with a cache so small that sequences are preempted and a chunked-prefill budget of 8;
  for the hybrids, a prompt beginning with an earlier one takes its kept state (``prefix_states``).
- stream (``--checks stream``): an FSDP2 trainer over the same ranks takes an optimizer step,
  its weights are streamed into the pipelined engine (`stream_full_weights`, every rank the
  whole stream, each stage keeping its own layers), and the next rollout equals the sharded
  recompute of the updated model, bitwise. Then a NaN written into the first stage's layer
  (``update_weights``): every rank's ``generate`` fails (the first stage naming the requests,
  whose logits the last stage flagged; the others dropping the call), the KV pages hold no
  NaN, and with the weight restored the rollout is the one before.

Ranks never assert (a failing rank would leave the others in a collective): each check is
recorded in ``<out>/rank<r>.json``.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fsdp_support import Results, make_model  # noqa: E402

from vexact_models.distributed import exit_rank  # noqa: E402
from vexact_models.registry import get  # noqa: E402
from vexact_models.runtime import LLM, SamplingParams  # noqa: E402
from vexact_models.runtime.linear_state_cache import linear_state_spec  # noqa: E402
from vexact_models.runtime.model_runner import kv_bytes_per_block  # noqa: E402
from vexact_models.runtime.pipeline import partition_layers  # noqa: E402

BLOCK = 4


def requests(vocab: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """Prompts (two share their first two pages) and one sampling setup per prompt."""
    prompts = [[(7 * i + 3 * j) % (vocab - 2) + 2 for j in range(n)] for i, n in enumerate((9, 5, 13, 3, 11))]
    prompts.append(prompts[2][:8] + [5, 6, 7])
    params = [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
              SamplingParams(temperature=1.0, max_tokens=7, seed=11, ignore_eos=True),
              SamplingParams(temperature=0.8, top_k=20, max_tokens=6, seed=12, n=3, ignore_eos=True),
              SamplingParams(temperature=1.2, top_p=0.7, max_tokens=5, seed=13, ignore_eos=True),
              SamplingParams(temperature=1.0, min_tokens=3, max_tokens=6, seed=14, stop_token_ids=[9, 10, 11, 12]),
              SamplingParams(temperature=0.9, max_tokens=6, seed=15, ignore_eos=True, min_p=0.05)]
    return prompts, params


def flat(outputs) -> list[tuple]:
    return [(o.request_id, o.prompt_token_ids, c.index, c.token_ids, c.logprobs, c.finish_reason)
            for o in outputs for c in o.outputs]


def recompute_matches(model, outputs, params) -> tuple[bool, str]:
    """Every completion's logprobs == ``token_logprobs`` of prompt + completion at its temperature."""
    bad, total = 0, 0
    for out, p in zip(outputs, params):
        for c in out.outputs:
            ids = torch.tensor([out.prompt_token_ids + c.token_ids])
            with torch.no_grad():
                lp = model.token_logprobs(ids, temperature=p.temperature or 1.0)[0, len(out.prompt_token_ids):]
            total += len(c.token_ids)
            bad += int(not torch.equal(lp, torch.tensor(c.logprobs)))
    return bad == 0 and total > 0, f"{bad} completions differ, {total} tokens checked"


def check_stage(res, tag, llm, world) -> None:
    stage = llm.pipeline_stage
    names = {n: p for n, p in llm.model.causal_lm.named_parameters(remove_duplicate=False)}
    tied = names["lm_head.weight"] is names["model.embed_tokens.weight"]
    wrong = [n for n, p in names.items()
             if p.is_meta == (stage.owns(n) or (tied and stage.is_last and n == "model.embed_tokens.weight"))]
    res.record(f"stage/{tag}/holds_only_its_tensors", stage is not None and stage.size == world and not wrong,
               f"stage {stage}: wrongly held or missing: {wrong[:4]}")
    linear = linear_state_spec(llm.model)
    gdn = set(() if linear is None else linear.layers)
    caches = [i for i, kv in enumerate(llm.runner.kv_caches) if kv is not None]
    res.record(f"stage/{tag}/kv_pages_for_its_layers", caches == [i for i in stage.layers if i not in gdn],
               f"KV caches of layers {caches}")
    states = [] if llm.runner.linear_states is None else list(llm.runner.linear_states.conv)
    res.record(f"stage/{tag}/states_for_its_gdn_layers", states == [i for i in stage.layers if i in gdn],
               f"gated-DeltaNet states of layers {states}")


def stage_budget(model, rank: int, world: int, pages: int, slots: int = 8) -> int:
    """This rank's ``kv_cache_bytes`` for `pages` KV pages of its stage's attention layers (one
    layer's worth at least) after the gated-DeltaNet states of its own layers (`slots` sequences),
    so that the engine gets exactly `pages` (a stage without attention layers takes the others')."""
    spec = model.kv_cache_spec()
    layers = partition_layers(spec[0], world)[rank]
    linear = linear_state_spec(model, layers)
    attention = len(layers) - (0 if linear is None else len(linear.layers))
    states = 0 if linear is None else slots * linear.bytes_per_slot(torch.float32)
    return pages * kv_bytes_per_block(spec, BLOCK, torch.float32) // spec[0] * max(1, attention) + states


def run_rollouts(res, arch, folder, base, rank, world) -> None:
    prompts, params = requests(base.config.vocab_size)
    outs = {}
    for name, kwargs in (("roomy", dict(kv_cache_bytes=stage_budget(base, rank, world, 256), max_num_batched_tokens=64)),
                         ("tight", dict(kv_cache_bytes=stage_budget(base, rank, world, 10), max_num_batched_tokens=8))):
        llm = LLM(str(folder), pipeline_parallel_size=world, device="cpu", block_size=BLOCK, max_num_seqs=8, **kwargs)
        if name == "roomy":
            check_stage(res, arch.name, llm, world)
            try:  # refused on every rank before any step: the stages never start one
                llm.generate(prompts[:1], SamplingParams(max_tokens=2, logprobs=1), use_tqdm=False)
                refused = "generated"
            except ValueError as err:
                refused = str(err)
            res.record(f"rollout/{arch.name}/roomy/alternatives_refused", "SamplingParams.logprobs" in refused, refused)
            # the penalties and grammars too: the last stage samples without the token counts or matchers
            for field, value in (("repetition_penalty", 1.2), ("structured_outputs", {"regex": "[a-z]+"}),
                                 ("bad_words", ["w1"])):
                try:
                    llm.generate(prompts[:1], SamplingParams(max_tokens=2, **{field: value}), use_tqdm=False)
                    refused = "generated"
                except ValueError as err:
                    refused = str(err)
                res.record(f"rollout/{arch.name}/roomy/{field}_refused",
                           "SamplingParams.repetition_penalty, frequency_penalty" in refused
                           and "not available on pipeline stages" in refused, refused)
        outs[name] = llm.generate(prompts, params, use_tqdm=False)
        res.record(f"rollout/{arch.name}/{name}/outputs", True, repr(flat(outs[name])))  # compared across ranks
        if rank == 0 and name == "tight":
            res.record(f"rollout/{arch.name}/tight/preempted", llm.num_preemptions > 0,
                       f"{llm.num_preemptions} preemptions")
        if rank == 0 and name == "roomy":
            hits = llm.block_manager.num_shared_hits
            res.record(f"rollout/{arch.name}/roomy/shared_prefix_pages", hits > 0, f"{hits} pages shared")
    if rank == 0:
        single = LLM(str(folder), device="cpu", block_size=BLOCK, max_num_seqs=8, max_num_batched_tokens=64,
                     kv_cache_bytes=stage_budget(base, 0, 1, 256))
        want = flat(single.generate(prompts, params, use_tqdm=False))
        for name, got in outs.items():
            res.record(f"rollout/{arch.name}/{name}/equals_single_process", flat(got) == want,
                       f"{len(want)} completions")
            res.record(f"rollout/{arch.name}/{name}/equals_recompute", *recompute_matches(base, got, params))
    if linear_state_spec(base) is not None:
        run_kept_states(res, arch, folder, base, rank, world)


def run_kept_states(res, arch, folder, base, rank, world) -> None:
    """A gated-DeltaNet hybrid's kept prompt states on stages (``prefix_states``): one sequence at a
    time, the second prompt begins with the first, whose state at its share point (12) every
    stage copied into a kept slot, and the third with the first's first 8 tokens, where the first
    stopped and kept its state too (a branch point); the second takes 12, the third 8, and all
    equal a single process's."""
    first = [(5 * j) % (base.config.vocab_size - 2) + 2 for j in range(13)]
    prompts = [first, first + [5, 6, 7, 8], first[:8] + [9, 9, 9, 9, 9]]
    params = [SamplingParams(temperature=1.0, max_tokens=4, seed=21 + i, ignore_eos=True) for i in range(3)]
    llm = LLM(str(folder), pipeline_parallel_size=world, device="cpu", block_size=BLOCK, max_num_seqs=1,
              kv_cache_bytes=stage_budget(base, rank, world, 64), prefix_states=2)
    got = llm.generate(prompts, params, use_tqdm=False)
    res.record(f"rollout/{arch.name}/kept/outputs", True, repr(flat(got)))  # compared across ranks
    if rank == 0:
        taken = llm.scheduler.num_prefix_state_tokens
        res.record(f"rollout/{arch.name}/kept/taken", taken == 12 + 8, f"{taken} prompt tokens taken from kept states")
        single = LLM(str(folder), device="cpu", block_size=BLOCK, max_num_seqs=1,
                     kv_cache_bytes=stage_budget(base, 0, 1, 64))
        res.record(f"rollout/{arch.name}/kept/equals_single_process",
                   flat(got) == flat(single.generate(prompts, params, use_tqdm=False)), "3 completions")
        res.record(f"rollout/{arch.name}/kept/equals_recompute", *recompute_matches(base, got, params))


def run_stream(res, arch, folder, base, rank, world) -> None:
    """FSDP2 trainer on the same ranks -> optimizer step -> stream -> rollout == sharded recompute."""
    from vexact_models.distributed import shard, stream_full_weights

    prompts, params = requests(base.config.vocab_size)
    llm = LLM(str(folder), pipeline_parallel_size=world, device="cpu", block_size=BLOCK, max_num_seqs=8,
              max_num_batched_tokens=64, kv_cache_bytes=stage_budget(base, rank, world, 128))
    trainer = shard(copy.deepcopy(base)).train()
    optim = torch.optim.AdamW(trainer.parameters(), lr=2e-2)
    before = flat(llm.generate(prompts, params, use_tqdm=False))
    ids = torch.tensor([[t for p in prompts for t in p]])
    positions = torch.tensor([[i for p in prompts for i in range(len(p))]])
    (-trainer.token_logprobs(ids, position_ids=positions).sum()).backward()
    optim.step()
    optim.zero_grad(set_to_none=True)
    llm.sleep(level=1)
    llm.wake_up(tags=["weights"])
    copied = llm.update_weights(stream_full_weights(trainer, bucket_bytes=1 << 14))
    llm.wake_up(tags=["kv_cache"])
    full = {n: p.full_tensor() for n, p in trainer.named_parameters()}
    held = {n: p for n, p in llm.model.causal_lm.named_parameters() if not p.is_meta}
    res.record(f"stream/{arch.name}/stage_weights_equal_trainer",
               copied == len(held) and all(torch.equal(p, full[n]) for n, p in held.items()),
               f"{copied} tensors copied, {len(held)} held of {len(full)}")
    outputs = llm.generate(prompts, params, use_tqdm=False)
    res.record(f"stream/{arch.name}/rollout_changed", flat(outputs) != before, "the new weights moved the rollout")
    trainer.eval()
    res.record(f"stream/{arch.name}/equals_sharded_recompute", *recompute_matches(trainer, outputs, params))
    run_nonfinite(res, arch, llm, full, outputs, prompts, params, rank)


def run_nonfinite(res, arch, llm, weights, outputs, prompts, params, rank) -> None:
    """A NaN in a norm weight of stage 0's first layer (the input norm of a pre-norm layer, OLMo 3's
    post-attention norm) reaches every logit on the last stage: every rank's generate raises, no
    NaN K/V is left, and the good weight gives `outputs` again."""
    name = next(n for n in weights if n.startswith("model.layers.0.") and n.endswith("layernorm.weight"))
    bad = weights[name].clone()
    bad[0] = float("nan")
    llm.update_weights({name: bad})
    try:
        llm.generate(prompts, params, use_tqdm=False)
        error = "no error"
    except RuntimeError as exc:
        error = str(exc)
    expected = "hold NaN or inf" if rank == 0 else "the first pipeline stage failed"
    res.record(f"nonfinite/{arch.name}/raises", expected in error, error[:300])
    finite = all(torch.isfinite(kv).all() for pair in llm.runner.kv_caches if pair is not None for kv in pair)
    states = llm.runner.linear_states  # the gated-DeltaNet hybrids' states are zeroed with the pages
    finite = finite and (states is None or all(torch.isfinite(t).all() for t in (*states.conv.values(),
                                                                                  *states.states.values())))
    res.record(f"nonfinite/{arch.name}/kv_cache_finite", finite, "every KV page (and GDN state) finite after the failure")
    llm.update_weights({name: weights[name]})
    again = [f[1:] for f in flat(llm.generate(prompts, params, use_tqdm=False))]  # (new request ids)
    res.record(f"nonfinite/{arch.name}/usable_after", again == [f[1:] for f in flat(outputs)], "the rollout before")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--archs", required=True, help="comma-separated architecture names")
    parser.add_argument("--checks", default="rollout", help="rollout and/or stream")
    parser.add_argument("--layers", type=int, default=0, help="decoder layers of the tiny configs (0: default)")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    checks = set(args.checks.split(","))
    res = Results()
    for name in args.archs.split(","):
        arch = get(name)
        try:
            overrides = {"num_hidden_layers": args.layers} if args.layers else {}
            base = make_model(arch, **overrides).eval()
            folder = args.out / f"ckpt_{arch.name}"
            if rank == 0:  # sharded with an index.json: the stages read only their tensors' files
                base.save_pretrained(folder, max_shard_size="40KB")
            dist.barrier()
            if "rollout" in checks:
                run_rollouts(res, arch, folder, base, rank, world)
            if "stream" in checks:
                run_stream(res, arch, folder, base, rank, world)
        except Exception as exc:  # recorded, not raised: the other ranks may be in a collective
            res.exception(f"crash/{arch.name}", exc)
            import traceback

            traceback.print_exc()
            break
    res.save(args.out, rank)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_rank(0)  # not a plain return: interpreter teardown with gloo threads alive can abort a rank
