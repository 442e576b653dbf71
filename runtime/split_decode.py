"""A decode step as two half batches on two CUDA streams, so that one half's attention (bound by
the cache reads) runs beside the other half's GEMMs and small kernels (bound by latency).

Why: at Qwen3-0.6B shape a decode step of 128 sequences spends ~2.2 ms in attention at 85% of
its bytes and ~1.0 ms in GEMMs that read 0.28 ms of weights; the GEMMs have too few output
tiles to fill the card (docs/gpu-results.md, thirtieth session). Run as two halves, each
half's GEMMs take about as long as the whole batch's did, but they can hide under the other
half's attention. The price: the weights are read once a half (from L2 when the two halves are
near each other).

No bit changes: every kernel computes a row the same in any batch (docs/design.md rules 1 and
2), and a half runs exactly the ops of the whole forward on its rows; only the sequences'
numbering restarts at 0 in the second half.

Modes (``VEXACT_DECODE_SPLIT``): ``off`` (one forward), ``free`` (the halves run unsynchronised)
and ``alternate`` (the halves' attention kernels take turns: a half's layer-i attention waits
for the other's last attention, so attentions never compete for bandwidth while everything
else overlaps).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from vexact_models.kernels import PagedLayout
from vexact_models.kernels.kernel_switch import KernelSwitch
from vexact_models.layers import PagedContext

__all__ = ["DECODE_SPLIT", "MIN_SPLIT_BATCH", "split_context", "split_decode_forward"]

DECODE_SPLIT = KernelSwitch("VEXACT_DECODE_SPLIT", ("off", "free", "alternate"), "off", "decode split mode")
#: the smallest decode bucket split in two (each half at least 32 sequences)
MIN_SPLIT_BATCH = 64


def _half_order(order: torch.Tensor, half: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The two halves' program orders from the whole step's (a permutation of 0..b-1): each
    half's sequences in the same relative order, numbered from 0. Device ops of fixed shape
    (capturable): a stable sort that moves the first half's sequences to the front."""
    second = (order >= half).to(torch.int32)
    ordered = order[torch.sort(second, stable=True).indices]
    return ordered[:half].contiguous(), (ordered[half:] - half).contiguous()


def split_context(context: PagedContext, half: int) -> tuple[PagedContext, PagedContext]:
    """`context` of a decode step (one token per sequence, token i of sequence i) as the contexts
    of its first `half` sequences and of the rest, each numbered from 0."""
    layout = context.layout
    cu = layout.cu_seqlens_q
    # padding sequences have cu = the real token count, which may be below `half`
    cu_second = (cu[half:] - half).clamp_(min=0)
    order = layout.seq_order
    orders = (None, None) if order is None else _half_order(order, half)
    parts = []
    for rows, cu_part, order_part in ((slice(0, half), cu[:half + 1], orders[0]),
                                      (slice(half, None), cu_second, orders[1])):
        part = PagedLayout(cu_part, layout.seq_lens[rows], layout.block_table[rows], layout.page_size,
                           layout.max_seqlen_q, order_part)
        parts.append(type(context)(part, context.slot_mapping[rows], context.kv_caches))
    return parts[0], parts[1]


@dataclass
class _TurnContext(PagedContext):
    """A half's context whose attention kernels take turns with the other half's: each waits
    for the event the other half recorded after its last attention, then records its own."""

    turns: "_Turns | None" = None
    side: int = 0

    def attend_cache(self, layer_idx: int, q, scale: float) -> torch.Tensor:
        self.turns.wait(self.side)
        out = super().attend_cache(layer_idx, q, scale)
        self.turns.done(self.side)
        return out


class _Turns:
    """The two halves' attention events: side 0 waits for side 1's previous attention, side 1
    for side 0's attention of the same layer."""

    def __init__(self) -> None:
        self.last: list[torch.cuda.Event | None] = [None, None]

    def wait(self, side: int) -> None:
        event = self.last[1 - side]
        if event is not None:
            torch.cuda.current_stream().wait_event(event)

    def done(self, side: int) -> None:
        event = torch.cuda.Event()
        event.record()
        self.last[side] = event


def split_decode_forward(model, ids: torch.Tensor, positions: torch.Tensor, context: PagedContext,
                         rows: torch.Tensor, side_stream: torch.cuda.Stream | None, mode: str) -> torch.Tensor:
    """`model`'s decode forward (an ``InferenceModel``: fp32 logits of the flat `rows`) as two
    halves, the second on `side_stream` (None: one after the other on the current stream, as
    on the CPU), synchronised as `mode` (``free`` or ``alternate``) says. The halves' layers are
    issued in turns (layer i of the first half, then of the second), so that the attention
    events exist when the other half waits for them. Bitwise ``model(ids, positions, context, rows)``."""
    half = len(ids) // 2
    contexts = split_context(context, half)
    if mode == "alternate" and side_stream is not None:
        turns = _Turns()
        contexts = tuple(_TurnContext(c.layout, c.slot_mapping, c.kv_caches, turns, side)
                         for side, c in enumerate(contexts))
    inputs = ((ids[:half], positions[:half]), (ids[half:], positions[half:]))
    carried: list[tuple[torch.Tensor, torch.Tensor] | tuple[None, None]] = [(None, None), (None, None)]
    main = torch.cuda.current_stream() if side_stream is not None else None
    if side_stream is not None:
        side_stream.wait_stream(main)
    for i in range(model.config.num_hidden_layers):
        for side in (0, 1):
            with torch.cuda.stream(side_stream) if side and side_stream is not None else contextlib.nullcontext():
                carried[side] = model.forward_stage(range(i, i + 1), i == 0, False, *inputs[side], contexts[side],
                                                    rows, *carried[side])
    if side_stream is not None:
        main.wait_stream(side_stream)
        for t in carried[1]:
            t.record_stream(main)
    hidden, residual = (torch.cat([a, b]) for a, b in zip(*carried))
    layers = model.config.num_hidden_layers
    return model.forward_stage(range(layers, layers), False, True, None, positions, context, rows, hidden, residual)

