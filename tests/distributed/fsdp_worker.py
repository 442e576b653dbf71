"""One rank of the FSDP2 checks (launched by tests/distributed/test_fsdp.py through torchrun,
gloo on CPU). For every architecture:

- logprobs: ``token_logprobs`` of a model sharded by `shard` (activation checkpointing off and
  on, training mode with autograd) on this rank's part of every data split, packed and padded,
  equals the single-process logprobs of the same sequences, bitwise; so does the plain
  ``fully_shard`` recipe, and ``forward``'s logits and loss.
- grads: after one backward of a token-count-normalised loss, the gathered gradients equal the
  single-process ones within fp32 reduction tolerance; checkpointing on and off agree bitwise.
- mp: with ``param_dtype=bf16`` over fp32 parameters the logprobs, and ``generate``'s tokens and
  logits, equal those of the model cast to bf16, bitwise; `stream_full_weights(dtype=bf16)` gives
  exactly those bf16 weights.
- offload: the same logprobs with ``shard(offload=True)``.
- generate: HF's ``generate`` on the sharded model, its steps over our KV cache
  (`runtime.generate_cache`), gives the unsharded model's tokens and logits, bitwise;
  ``LLM(model)`` and ``generate_batch`` (the rollout engine, whole weights) are ValueErrors naming
  the sharding.
- stream: `stream_full_weights` yields every parameter once, under its checkpoint name, equal to
  the unsharded values, holding no more than a bucket.
- iteration (see fsdp_iteration.py): rollout -> recompute -> step -> stream -> rollout.
"""

from __future__ import annotations

import argparse
import copy
import sys
import weakref
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fsdp_support import (Results, equal_lists, make_model, make_sequences, packed, padded,  # noqa: E402
                          per_sequence, splits)

from vexact_models.distributed import exit_rank, shard, stream_full_weights  # noqa: E402
from vexact_models.registry import architectures  # noqa: E402
from vexact_models.runtime import LLM  # noqa: E402


def reference(model, seqs):
    """Single-process logprobs per sequence (one packed batch) and the gradients of the loss
    ``-sum(logprobs) / predicted tokens`` (training mode, as the sharded side runs)."""
    ref = copy.deepcopy(model).train()
    batch = packed(seqs)
    lp = ref.token_logprobs(**batch)
    n_pred = sum(len(s) - 1 for s in seqs)
    (-lp.sum() / n_pred).backward()
    grads = {n: p.grad.clone() for n, p in ref.named_parameters()}
    return [t.detach() for t in per_sequence(lp, batch, seqs)], grads, n_pred


def check_logprobs(res, tag, model, seqs, ref_lp, rank, world):
    """Every split x input format: this rank's sequences against the reference, bitwise."""
    for split_name, per_rank in splits(len(seqs), world).items():
        for fmt in ("packed", "padded_left", "padded_right"):
            got, want = [], []
            for micro in per_rank[rank]:
                mseqs = [seqs[i] for i in micro]
                batch = packed(mseqs) if fmt == "packed" else padded(mseqs, left=fmt == "padded_left")
                lp = model.token_logprobs(**batch)
                got += [t.detach() for t in per_sequence(lp, batch, mseqs)]
                want += [ref_lp[i] for i in micro]
            res.record(f"logprobs/{tag}/{split_name}/{fmt}", *equal_lists(got, want))


def grad_step(model, seqs, rank, world, n_pred):
    """Backward of this rank's share of ``-sum(logprobs) / predicted tokens`` (times the world
    size: FSDP averages gradients over ranks); returns the full gradients."""
    mine = [seqs[i] for i in splits(len(seqs), world)["round_robin"][rank][0]]
    lp = model.token_logprobs(**packed(mine))
    (-lp.sum() * world / n_pred).backward()
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return grads


def compare_grads(got, want) -> tuple[bool, str]:
    worst, where = 0.0, ""
    for name, g in want.items():
        scale = g.abs().max().item() or 1.0
        err = (got[name] - g).abs().max().item() / scale
        if err > worst:
            worst, where = err, name
    return worst <= 1e-5, f"worst relative max |diff| {worst:.3g} at {where or '-'}"


def check_forward_and_loss(res, arch, model, base, seqs, rank, world):
    """HF forward on the sharded model: logits and loss on this rank's padded batch equal the
    unsharded model's, bitwise."""
    mine = [seqs[i] for i in splits(len(seqs), world)["round_robin"][rank][0]]
    batch = padded(mine, left=False)
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    with torch.no_grad():
        out, ref = model(**batch, labels=labels), base(**batch, labels=labels)
    res.record(f"forward/{arch.name}/logits", torch.equal(out.logits, ref.logits), "padded logits")
    res.record(f"forward/{arch.name}/loss", torch.equal(out.loss, ref.loss), f"{out.loss.item()} vs {ref.loss.item()}")


def check_generate(res, arch, model, base, seqs, rank, world):
    """Greedy ``generate`` on the sharded model from this rank's left-padded prompts (every rank
    runs the same number of steps: the layers' all-gathers are collectives) equals the unsharded
    model's: tokens and every step's logits."""
    mine = [seqs[i][:6] for i in splits(len(seqs), world)["round_robin"][rank][0]]
    kwargs = dict(**padded(mine, left=True), max_new_tokens=3, do_sample=False, eos_token_id=None, pad_token_id=0,
                  output_logits=True, return_dict_in_generate=True)
    out, ref = model.generate(**kwargs), base.generate(**kwargs)
    same = torch.equal(out.sequences, ref.sequences) and all(map(torch.equal, out.logits, ref.logits))
    res.record(f"generate/{arch.name}/sharded_equals_single", same, "tokens and every step's logits")
    refusals = []
    for call in (lambda: model.generate_batch(mine, max_new_tokens=2), lambda: LLM(model, kv_cache_bytes=1 << 24)):
        try:  # the rollout engine (generate_batch runs one) takes whole weights: a named error, nothing built
            call()
            refusals.append("ran")
        except ValueError as error:
            refusals.append(str(error))
    named = "generate()" in refusals[0] and all("sharded (DTensor" in r for r in refusals)
    res.record(f"generate/{arch.name}/engine_refused", named, " | ".join(r[:150] for r in refusals))


def check_plain_recipe(res, arch, base, seqs, ref_lp, rank, world):
    """The user's own fully_shard calls (layers, then the root), no helper, no registration."""
    from torch.distributed.fsdp import fully_shard

    model = copy.deepcopy(base)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    mine = splits(len(seqs), world)["round_robin"][rank][0]
    with torch.no_grad():
        lp = model.token_logprobs(**packed([seqs[i] for i in mine]))
    got = per_sequence(lp, packed([seqs[i] for i in mine]), [seqs[i] for i in mine])
    res.record(f"logprobs/{arch.name}/plain_fully_shard", *equal_lists(got, [ref_lp[i] for i in mine]))


def check_stream(res, arch, model, base, bucket_bytes):
    """Names, values and the memory bound of stream_full_weights."""
    want = dict(base.named_parameters())  # the checkpoint names, tied weights once
    largest = max(p.numel() * p.element_size() for p in want.values())
    names, ok_values, alive_max = [], True, 0
    alive: list[weakref.ref] = []
    for name, tensor in stream_full_weights(model, bucket_bytes=bucket_bytes):
        names.append(name)
        ok_values &= name in want and torch.equal(tensor, want[name].detach())
        alive.append(weakref.ref(tensor))
        del tensor
        alive_max = max(alive_max, sum(r().numel() * r().element_size() for r in alive if r() is not None))
    res.record(f"stream/{arch.name}/names", names == list(want), f"{len(names)} names, want {len(want)}")
    res.record(f"stream/{arch.name}/values", ok_values, "bitwise the unsharded parameters")
    bound = max(bucket_bytes, largest)
    res.record(f"stream/{arch.name}/bucket_bound", alive_max <= bound,
               f"at most {alive_max} bytes of yielded tensors alive, bucket bound {bound}")


def check_mixed_precision(res, arch, base, seqs, ref_rank_seqs):
    model = shard(copy.deepcopy(base), param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    bf16 = copy.deepcopy(base).to(torch.bfloat16)
    batch = packed(ref_rank_seqs)
    # per-sequence temperatures that bf16 cannot represent: FSDP must not cast them
    temps = torch.linspace(0.7, 1.3, len(ref_rank_seqs)) + 1e-4
    with torch.no_grad():
        got = model.token_logprobs(**batch, temperature=temps)
        want = bf16.token_logprobs(**batch, temperature=temps)
    res.record(f"mp/{arch.name}/logprobs_bf16", torch.equal(got, want),
               f"max |diff| {(got - want).abs().max().item():.3g}")
    kwargs = dict(**padded([s[:6] for s in ref_rank_seqs], left=True), max_new_tokens=3, do_sample=False,
                  eos_token_id=None, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    out, ref = model.generate(**kwargs), bf16.generate(**kwargs)  # the cache in the compute dtype, bf16
    res.record(f"mp/{arch.name}/generate_bf16", torch.equal(out.sequences, ref.sequences) and all(
        map(torch.equal, out.logits, ref.logits)), "generate's tokens and logits == the bf16 model's")
    streamed = dict(stream_full_weights(model, bucket_bytes=1 << 14, dtype=torch.bfloat16))
    res.record(f"mp/{arch.name}/stream_bf16",
               all(torch.equal(streamed[n], p) for n, p in bf16.named_parameters()) and len(streamed) == len(
                   list(bf16.parameters())), "streamed bf16 == model.to(bf16)")


def check_offload(res, arch, base, seqs, ref_lp, mine):
    """CPU offload (CPUOffloadPolicy): on CPU this runs FSDP's offload code path, not its H2D copies."""
    model = shard(copy.deepcopy(base), offload=True).train()
    batch = packed([seqs[i] for i in mine])
    lp = model.token_logprobs(**batch)
    lp.sum().backward()
    got = per_sequence(lp.detach(), batch, [seqs[i] for i in mine])
    res.record(f"offload/{arch.name}/logprobs", *equal_lists(got, [ref_lp[i] for i in mine]))


def run_arch(res, arch, rank, world, checks):
    base = make_model(arch)
    seqs = make_sequences(base.config.vocab_size)
    ref_lp, ref_grads, n_pred = reference(base, seqs)
    grads = {}
    for ckpt in (False, True):
        tag = f"{arch.name}/{'ckpt' if ckpt else 'no_ckpt'}"
        model = shard(copy.deepcopy(base), activation_checkpointing=ckpt).train()
        check_logprobs(res, tag, model, seqs, ref_lp, rank, world)
        if "grads" in checks:
            grads[ckpt] = grad_step(model, seqs, rank, world, n_pred)
            res.record(f"grads/{tag}/vs_single_process", *compare_grads(grads[ckpt], ref_grads))
        if not ckpt:
            check_forward_and_loss(res, arch, model.eval(), base, seqs, rank, world)
            check_generate(res, arch, model, base, seqs, rank, world)
            if "stream" in checks:
                for bucket in (1, 4096, 1 << 30):
                    check_stream(res, arch, model, base, bucket)
    if "grads" in checks:
        same = all(torch.equal(grads[False][n], grads[True][n]) for n in grads[False])
        res.record(f"grads/{arch.name}/ckpt_equals_no_ckpt", same, "activation checkpointing on vs off, bitwise")
    check_plain_recipe(res, arch, base, seqs, ref_lp, rank, world)
    if "mp" in checks:
        mine = splits(len(seqs), world)["round_robin"][rank][0]
        check_mixed_precision(res, arch, base, seqs, [seqs[i] for i in mine])
        check_offload(res, arch, base, seqs, ref_lp, mine)
    if "iteration" in checks:  # the iteration rolls out
        from fsdp_iteration import run_iteration

        run_iteration(res, arch, base, rank, world)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--archs", default="all", help="comma-separated architecture names")
    parser.add_argument("--checks", default="grads,stream,mp,iteration")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    checks = set(args.checks.split(","))
    res = Results()
    for arch in architectures():
        if args.archs != "all" and arch.name not in args.archs.split(","):
            continue
        try:
            run_arch(res, arch, rank, world, checks)
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
