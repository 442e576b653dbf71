"""The steps of a pipeline-parallel engine (`runtime.pipeline`): the first stage's side of a
step, and the loop every other stage runs while a ``generate`` call lasts.

First stage, per step: build the step's inputs and sampling rows, send them to every stage
(the plan), run its layers, send the hidden states and residual stream on, wait for the
sampled tokens and logprobs from the last stage, hand them to the scheduler. Other stages, per
step: take the plan, take the previous stage's hidden states, run their layers (writing their
KV pages), then send the hidden states on or (last stage) sample and send the results back.
The decode CUDA graphs of each stage replay as on a single process. Steps run one at a time
(no micro-batches in flight): the stages take turns, which lets a model larger than one GPU
roll out with the single-GPU arithmetic.
"""

from __future__ import annotations

from .pipeline import PipelineStage
from .pipeline_comm import ABORT, END, PipelineComm
from .sampler import sample_host_rows, spread_samples
from .scheduled import ScheduledSeq

__all__ = ["Pipeline"]


class Pipeline:
    """One process's stage of a pipeline-parallel `LLM`, and its messages."""

    def __init__(self, stage: PipelineStage, comm: PipelineComm) -> None:
        self.stage = stage
        self.comm = comm
        self._in_step = False  # inside a step's messages: the other stages are waiting for some

    def execute_first(self, llm, scheduled: list[ScheduledSeq]) -> tuple[list[int | None], list[float | None]]:
        """First stage: run one scheduled step through every stage; the token and logprob of
        each scheduled sequence (None for a non-final prefill chunk), as ``LaunchedStep.results``."""
        runner = llm.runner
        inputs = runner.build_inputs(scheduled)
        rows = llm.sampler.host_rows([item.seq for item in scheduled if item.samples])
        self._in_step = True
        self.comm.send_plan(inputs, rows)
        hidden, residual = runner.run(inputs)
        self.comm.send_carry(hidden, residual)
        tokens, logprobs = self.comm.recv_samples(len(rows.temps))
        self._in_step = False
        return spread_samples(scheduled, tokens, logprobs)

    def serve(self, llm) -> None:
        """Other stages: run the first stage's steps until it says the ``generate`` call is done."""
        comm, runner = self.comm, llm.runner
        while True:
            kind, inputs, rows = comm.recv_plan()
            if kind == END:
                return
            if kind == ABORT:  # its K/V may be non-finite (`EngineStepsMixin._check_finite`)
                runner.zero_cache()
                raise RuntimeError(f"LLM.generate: the first pipeline stage failed between steps; stage "
                                   f"{self.stage.index} drops the call (see the first stage's error)")
            out = runner.run(inputs, comm.recv_carry(len(inputs.ids)))
            if self.stage.is_last:
                comm.send_samples(*sample_host_rows(out, rows))
            else:
                comm.send_carry(*out)

    def finish(self, outputs=None):
        """End of a ``generate`` call on every stage: the first stage tells the others it is
        done and shares its `outputs`; every stage returns them."""
        if self.stage.is_first:
            self.comm.send_control(END)
        return self.comm.share(outputs)

    def abort(self) -> None:
        """First stage, after a failure: tell the other stages, unless the failure came inside a
        step's messages (then the process group is out of step, and the job must be ended, as
        after any failed collective)."""
        if self.stage.is_first and not self._in_step:
            self.comm.send_control(ABORT)
