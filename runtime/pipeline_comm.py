"""The messages of a pipeline-parallel engine (see `runtime.pipeline`), over torch.distributed.

Per step, in this order:

1. plan (first stage -> every stage, a broadcast over a CPU (gloo) group): an int64 header
   (kind, token/sequence/sampling-row counts, table width, longest chunk, bans, state copies,
   whether the step carries a window page group) and, for a step, one byte buffer with the
   step's `StepInputs` (with the sequences' state slots and the gated-DeltaNet slot copies,
   which every stage applies to its own layers; with the window group's slots and block tables,
   `runtime.page_groups`, which every stage's windowed layers read) and the sampling rows'
   `HostRows`;
   ``END`` (the ``generate`` call is done) and ``ABORT`` (the first stage failed between
   steps) are a header alone;
2. carry (stage s -> s + 1, point to point on the default group: NCCL on CUDA, gloo on CPU):
   the hidden states and the residual stream, ``[tokens, hidden_size]`` each, in the model
   dtype; sent as they are, so the next stage continues from bitwise the same values;
3. samples (last stage -> first, over the CPU group): ``float64 [2, rows]``, the sampled tokens
   and their logprobs (exact in float64), only when the step samples.

After ``END``, the first stage broadcasts the ``generate`` outputs, so that every rank returns
them. When the default group cannot move CUDA tensors (gloo, e.g. two stages sharing one GPU
in a test), the carry goes through host memory.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from .sampler import HostRows
from .staging import Layout
from .step_inputs import StepInputs

__all__ = ["ABORT", "END", "STEP", "PipelineComm"]

STEP, END, ABORT = 1, 2, 3
_HEADER = 9
_I64, _I32, _F64, _F32 = (np.dtype(t) for t in (np.int64, np.int32, np.float64, np.float32))


def _plan_layout(tokens: int, seqs: int, rows: int, width: int, bans: int, copies: int, window: bool) -> Layout:
    """Where each array of a step's plan sits in its byte buffer (`_plan_arrays`' order; the
    window group's two arrays empty without one)."""
    grouped_tokens, grouped_seqs = (tokens, seqs) if window else (0, 0)
    return Layout([(_I64, (tokens,)), (_I64, (tokens,)), (_I64, (tokens,)), (_I64, (rows,)), (_I32, (seqs + 1,)),
                   (_I32, (seqs,)), (_I32, (seqs,)), (_I32, (seqs, width)), (_I64, (seqs,)), (_I64, (copies, 2)),
                   (_F32, (rows,)), (_F64, (rows,)), (_I64, (rows,)), (_F32, (rows,)), (_I64, (rows,)), (_I64, (rows,)),
                   (_I64, (bans, 2)),
                   (_I64, (grouped_tokens,)), (_I32, (grouped_seqs, width))])


def _plan_arrays(inputs: StepInputs, rows: HostRows) -> list[np.ndarray]:
    if inputs.seq_rows is None:
        raise RuntimeError("PipelineComm: a step's plan needs the sequences' block-table rows (their state slots): "
                           "connect the first stage's runner to its scheduler (EngineConfig.connect)")
    window = [] if inputs.window_slots is None else [inputs.window_slots, inputs.window_block_table]
    return [inputs.ids, inputs.positions, inputs.slots, inputs.logits_rows, inputs.cu_seqlens, inputs.seq_lens,
            inputs.seq_order, inputs.block_table, inputs.seq_rows, inputs.state_copies, rows.temps, rows.top_p,
            rows.top_k, rows.log_min_p, rows.seeds, rows.steps, rows.bans, *window]


class PipelineComm:
    """One stage's end of the messages above. Construct it on every rank at once (it may
    create a gloo group: a collective)."""

    def __init__(self, index: int, size: int, device: torch.device, dtype: torch.dtype, hidden_size: int) -> None:
        self.index, self.size = index, size
        self.device, self.dtype, self.hidden_size = device, dtype, hidden_size
        backend = str(dist.get_backend())
        # plans, samples and outputs are host data: a gloo group carries them whatever moves the carries
        self.cpu_group = None if "gloo" in backend else dist.new_group(backend="gloo")
        self.carry_via_host = device.type == "cuda" and "nccl" not in backend

    # -- plans ---------------------------------------------------------------------------
    def send_plan(self, inputs: StepInputs, rows: HostRows) -> None:
        """First stage: a step's inputs and sampling rows to every stage."""
        tokens, seqs, width = len(inputs.ids), len(inputs.seq_lens), inputs.block_table.shape[1]
        arrays = _plan_arrays(inputs, rows)
        copies, window = len(inputs.state_copies), inputs.window_slots is not None
        header = [STEP, tokens, seqs, len(rows.temps), width, inputs.max_seqlen_q, len(rows.bans), copies, int(window)]
        self._broadcast(torch.tensor(header, dtype=torch.int64))
        layout = _plan_layout(tokens, seqs, len(rows.temps), width, len(rows.bans), copies, window)
        buffer = layout.allocate(torch.device("cpu"))
        for view, array in zip(layout.host_views(buffer), arrays):
            view[...] = array
        self._broadcast(buffer)

    def send_control(self, kind: int) -> None:
        """First stage: ``END`` or ``ABORT`` to every stage."""
        self._broadcast(torch.tensor([kind] + [0] * (_HEADER - 1), dtype=torch.int64))

    def recv_plan(self) -> tuple[int, StepInputs | None, HostRows | None]:
        """Other stages: the next message, ``(kind, inputs, rows)`` (None, None unless STEP)."""
        header = torch.empty(_HEADER, dtype=torch.int64)
        self._broadcast(header)
        kind, tokens, seqs, num_rows, width, max_q, bans, copies, window = header.tolist()
        if kind != STEP:
            return kind, None, None
        layout = _plan_layout(tokens, seqs, num_rows, width, bans, copies, bool(window))
        buffer = layout.allocate(torch.device("cpu"))
        self._broadcast(buffer)
        (ids, positions, slots, logits_rows, cu, lens, order, table, seq_rows, state_copies, temps, top_p, top_k,
         log_min_p, seeds, steps, banned, window_slots, window_table) = layout.host_views(buffer)
        inputs = StepInputs(ids=ids, positions=positions, slots=slots, logits_rows=logits_rows, cu_seqlens=cu,
                            seq_lens=lens, block_table=table, seq_order=order, max_seqlen_q=max_q, seq_rows=seq_rows,
                            state_copies=state_copies, window_slots=window_slots if window else None,
                            window_block_table=window_table if window else None)
        return kind, inputs, HostRows(temps, top_p, top_k, log_min_p, seeds, steps, banned)

    def _broadcast(self, tensor: torch.Tensor) -> None:
        dist.broadcast(tensor, src=self._rank(0), group=self.cpu_group)

    # -- carries -------------------------------------------------------------------------
    def send_carry(self, hidden: torch.Tensor, residual: torch.Tensor) -> None:
        """To the next stage: this stage's hidden states and residual stream."""
        for tensor in (hidden, residual):
            tensor = tensor.contiguous()
            dist.send(tensor.cpu() if self.carry_via_host else tensor, dst=self._rank(self.index + 1))

    def recv_carry(self, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """From the previous stage: ``(hidden, residual)`` of a step of `tokens` tokens."""
        device = torch.device("cpu") if self.carry_via_host else self.device
        out = []
        for _ in range(2):
            tensor = torch.empty(tokens, self.hidden_size, dtype=self.dtype, device=device)
            dist.recv(tensor, src=self._rank(self.index - 1))
            out.append(tensor.to(self.device) if self.carry_via_host else tensor)
        return out[0], out[1]

    # -- samples and outputs -------------------------------------------------------------
    def send_samples(self, tokens: list[int], logprobs: list[float]) -> None:
        """Last stage: the step's sampled tokens and logprobs to the first stage."""
        if tokens:
            dist.send(torch.tensor([tokens, logprobs], dtype=torch.float64), dst=self._rank(0), group=self.cpu_group)

    def recv_samples(self, rows: int) -> tuple[list[int], list[float]]:
        """First stage: what the last stage sampled for the step's `rows` sampling rows."""
        if not rows:
            return [], []
        both = torch.empty(2, rows, dtype=torch.float64)
        dist.recv(both, src=self._rank(self.size - 1), group=self.cpu_group)
        return both[0].long().tolist(), both[1].float().tolist()

    def share(self, value=None):
        """Every rank gets the first stage's `value` (a picklable object: the outputs)."""
        box = [value]
        dist.broadcast_object_list(box, src=self._rank(0), group=self.cpu_group)
        return box[0]

    def min_over_stages(self, value: int) -> int:
        """The smallest of every stage's `value` (the KV pages all stages can hold)."""
        tensor = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(tensor.item())

    def _rank(self, stage: int) -> int:
        """The global rank of `stage` (stage s is rank s of the default group)."""
        return stage
