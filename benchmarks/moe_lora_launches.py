"""The experts' LoRA launch by launch (`kernels/moe_lora.py`), for `moe.py --lora` (CUDA only).

At Qwen3-30B-A3B's MoE layer (hidden 2048, 128 experts, top-8, expert intermediate 768),
uniformly random routing, bf16 rows, fp32 adapters in PEFT's layout: per token count and
expert tensor (gate/up, down), the GPU microseconds in a CUDA graph (`bench_graph`, as a decode
step replays them) of the tensor's base GEMM (the peer), the copy of B by expert
(`expert_lora.b_by_expert_triton`; torch's copy of the permuted view beside it), both shrinks
(the training forward's partials; the rollout's u, the partials added in the program), the four
expands (of the partials or of u, each reading B in PEFT's layout and reading the copy), and
the rollout's launcher as the layer runs it in line (`moe_lora_add_triton` without u kept: the
summing shrink, the expand of u and the copy where `expert_b_operand` takes it, "picked"; in
the engine's captured steps the shrink and the copy run beside the base GEMM instead,
`moe_lora_shrink_beside`). The adapters rotate through copies that overflow the L2
cache, as each layer of a step reads its own. "bits" says whether the four expands' rows are
bitwise equal (they must: the same values, products and sums).
"""

from __future__ import annotations

import torch

from bench_utils import bench_graph, rotating_copies

HIDDEN, EXPERTS, INTER, TOP_K = 2048, 128, 768, 8


def _adapters(rank: int, n: int, k: int, experts: int, device: str, gen: torch.Generator, rotate: bool) -> list:
    from vexact_models.kernels import ExpertLora

    a = (torch.randn(experts * rank, k, generator=gen) / k ** 0.5).to(device)
    b = (torch.randn(n, rank * experts, generator=gen) * 0.1).to(device)
    copies = zip(rotating_copies(a), rotating_copies(b)) if rotate else [(a, b)]
    return [ExpertLora(ca, cb, 2.0) for ca, cb in copies]


def _tensor_rows(us, base: torch.Tensor, rows_in: torch.Tensor, gather: bool, loras: list, layout, top_k: int,
                 base_gemm, picked: bool) -> list[tuple]:
    """One expert tensor's rows ``(launch, us, bits, picked)``: `base` its base GEMM's sorted rows,
    `rows_in` the GEMM's input (tokens, `gather`, or the sorted rows), `loras` the adapter's copies,
    `picked` whether the launcher copies B at this call; `us` times a list of functions."""
    from vexact_models.kernels.expert_lora import b_by_expert_triton, expert_b_operand
    from vexact_models.kernels.moe_lora import (IDENTITY, moe_lora_add_triton, moe_lora_expand_triton,
                                                moe_lora_expand_u_triton, moe_lora_shrink_triton)

    experts = layout.expert_offsets.shape[0] - 1

    def shrink(lo, summed):
        return moe_lora_shrink_triton(rows_in, lo, layout, experts, top_k, gather, True, summed)

    inputs = {False: shrink(loras[0], False), True: shrink(loras[0], True)}  # partials; u rank-major
    operands = {regroup: [expert_b_operand(lo, experts, layout.num_pairs, regroup) for lo in loras]
                for regroup in (False, True)}

    def expand(out, lo, summed, operand):
        if summed:
            moe_lora_expand_u_triton(out, inputs[True], lo, layout, experts, IDENTITY, operand)
        else:
            moe_lora_expand_triton(out, inputs[False], lo, layout, experts, IDENTITY, None, operand)

    kinds = [(summed, regroup) for summed in (False, True) for regroup in (False, True)]
    results = []
    for summed, regroup in kinds:
        result = base.clone()
        expand(result, loras[0], summed, operands[regroup][0])
        results.append(result[layout.pair_pos])  # the pairs' rows (padding rows may hold anything)
    same = "yes" if all(torch.equal(results[0], r) for r in results[1:]) else "NO"
    scratch = base.clone()
    rows = [("base GEMM (peer)", us([base_gemm]), "", ""),
            ("B copy by expert", us([lambda lo=lo: b_by_expert_triton(lo.b, experts) for lo in loras]), "", ""),
            ("B copy, torch's of the permuted view", us([lambda lo=lo: lo.b_by_expert(experts) for lo in loras]),
             "", ""),
            ("shrink, partials (training)", us([lambda lo=lo: shrink(lo, False) for lo in loras]), "", ""),
            ("shrink, u summed (rollout)", us([lambda lo=lo: shrink(lo, True) for lo in loras]), "", "")]
    for summed, regroup in kinds:
        label = (f"expand {'of u (rollout)' if summed else 'of partials (training)'}, "
                 f"{'B copied (copy apart)' if regroup else 'B in PEFT layout'}")
        rows.append((label, us([lambda lo=lo, op=op, summed=summed: expand(scratch, lo, summed, op)
                                for lo, op in zip(loras, operands[regroup])]), same,
                     "yes" if summed and regroup == picked else ""))
    rows.append(("the rollout's launcher (shrink, expand, copy if picked)", us([lambda lo=lo: moe_lora_add_triton(
        scratch, rows_in, lo, layout, experts, top_k, gather) for lo in loras]), "", ""))
    return rows


def launch_rows(rank: int, token_counts: list[int], device: str = "cuda", graph_timer=None,
                shape: tuple[int, int, int, int] = (HIDDEN, EXPERTS, INTER, TOP_K)) -> list[list]:
    """Rows ``[tokens, pairs an expert, tensor, launch, us, bits, picked]`` (module docstring) at the
    MoE `shape` (hidden, experts, expert intermediate, top-k). `graph_timer` (`bench_graph` by
    default) is the clock; the tests pass a CPU one."""
    from vexact_models.kernels.moe import gate_up_act, moe_align
    from vexact_models.kernels.moe_activation import expert_activation_rows
    from vexact_models.kernels.moe_config import pick_config
    from vexact_models.kernels.moe_grouped_gemm import grouped_gemm
    from vexact_models.kernels.expert_lora import copies_b

    graph_timer = graph_timer or bench_graph

    def us(fns) -> str:
        return f"{graph_timer(fns) * 1e3:.1f}"

    hidden, experts, inter, top_k = shape
    gen = torch.Generator().manual_seed(0)
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5).bfloat16().to(device)
    down = (torch.randn(experts, hidden, inter, generator=gen) / inter ** 0.5).bfloat16().to(device)
    rotate = device == "cuda"
    adapters = {"gate/up": _adapters(rank, 2 * inter, hidden, experts, device, gen, rotate),
                "down": _adapters(rank, hidden, inter, experts, device, gen, rotate)}
    out = []
    for tokens in token_counts:
        x = torch.randn(tokens, hidden, generator=gen).bfloat16().to(device)
        ids = torch.randn(tokens, experts, generator=gen).topk(top_k, -1).indices.to(device)
        cfg = pick_config(tokens, top_k, experts)
        layout = moe_align(ids, experts, cfg.block_m)
        layout.config = cfg

        def gate_up_gemm():
            return gate_up_act(x, gate_up, layout, top_k, cfg, True, store_act=False)[1]

        def down_gemm():
            return grouped_gemm(act, down, layout, hidden, inter, down.stride(1), down.stride(2), x.dtype, cfg,
                                down_tiles=True)

        preact = gate_up_gemm()
        act = expert_activation_rows(preact, None, layout.block_expert, cfg.block_m)
        picked = copies_b(experts, layout.num_pairs)
        for tensor, base, rows_in, gather, gemm in (("gate/up", preact, x, True, gate_up_gemm),
                                                     ("down", down_gemm(), act, False, down_gemm)):
            rows = _tensor_rows(us, base, rows_in, gather, adapters[tensor], layout, top_k, gemm, picked)
            out += [[tokens, f"{tokens * top_k / experts:.1f}", tensor, *row] for row in rows]
    return out
