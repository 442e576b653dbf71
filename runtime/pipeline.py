"""Pipeline-parallel rollout: which decoder layers each stage runs, and the stage's model.

``LLM(model_or_path, pipeline_parallel_size=P)`` runs on P processes, one per stage (every rank
of a process group of world size P constructs it and calls ``generate`` with the same
arguments, e.g. under torchrun). Stage s (the process of rank s) owns a contiguous range of
decoder layers (`partition_layers`), their KV pages and (on CUDA) its own decode CUDA graphs;
the first stage also embeds the tokens, the last also runs the final norm, the LM head and the
sampler. The scheduler and block manager live on the first stage, which sends each step's plan
to the others (`pipeline_comm`); hidden states and the residual stream go stage to stage
point to point; the last stage sends the sampled tokens and logprobs back
(`pipeline_worker`). Each layer runs the single-process arithmetic on the same rows, so the
logprobs equal a single-process rollout and the training forward bitwise (docs/pipeline.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["PipelineStage", "StageModel", "check_stage_model", "join_pipeline", "partition_layers"]


def partition_layers(num_layers: int, size: int) -> list[range]:
    """Contiguous decoder-layer ranges of `size` stages covering ``range(num_layers)``: as even as
    possible, the first ``num_layers % size`` stages one layer more (the last stage also runs
    the LM head, the heaviest GEMM of a decode step)."""
    if not 1 <= size <= num_layers:
        raise ValueError(f"partition_layers: size={size} is outside [1, num_layers={num_layers}]")
    base, extra = divmod(num_layers, size)
    ranges, start = [], 0
    for s in range(size):
        end = start + base + (1 if s < extra else 0)
        ranges.append(range(start, end))
        start = end
    return ranges


@dataclass(frozen=True)
class PipelineStage:
    """One stage of a pipeline: its index (its rank in the process group), the number of
    stages and the decoder layers it runs (out of ``num_layers``)."""

    index: int
    size: int
    layers: range
    num_layers: int

    @property
    def is_first(self) -> bool:
        """Embeds the tokens and holds the scheduler."""
        return self.index == 0

    @property
    def is_last(self) -> bool:
        """Runs the final norm, the LM head and the sampler."""
        return self.index == self.size - 1

    def owns(self, name: str) -> bool:
        """Whether the parameter or buffer `name` (an HF checkpoint name of a causal LM) is this
        stage's: its decoder layers', the embeddings on the first stage, the final norm and
        the LM head on the last."""
        if name.startswith("model.layers."):
            return int(name.split(".", 3)[2]) in self.layers
        if name.startswith("model.embed_tokens."):
            return self.is_first
        return self.is_last  # model.norm.*, lm_head.*


def join_pipeline(size: int, config) -> PipelineStage | None:
    """This process's stage of a `size`-stage pipeline over the default process group (None
    when `size` is 1). ValueError naming ``pipeline_parallel_size`` when `size` is above the
    model's decoder layers, or when no process group of world size `size` exists."""
    if size == 1:
        return None
    layers = int(config.num_hidden_layers)
    if size > layers:
        raise ValueError(f"LLM: pipeline_parallel_size={size} is above the model's num_hidden_layers={layers} (each "
                         "stage needs at least one decoder layer)")
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(f"LLM: pipeline_parallel_size={size} needs torch.distributed initialised with {size} processes, "
                         "one per stage (e.g. torchrun --nproc-per-node "
                         f"{size} ... and dist.init_process_group()), but no process group exists")
    world = dist.get_world_size()
    if world != size:
        raise ValueError(f"LLM: pipeline_parallel_size={size} must equal the process group's world size {world} (every "
                         "rank is one stage)")
    rank = dist.get_rank()
    return PipelineStage(rank, size, partition_layers(layers, size)[rank], layers)


def check_stage_model(model, stage: PipelineStage) -> None:
    """A model instance handed to a pipeline stage must hold the stage's tensors (the others may
    be on the meta device, e.g. `pipeline_load.empty_stage_model`): ValueError naming the ones
    it lacks."""
    tensors = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False))
    missing = [name for name, t in tensors if t.is_meta and stage.owns(name)]
    if missing:
        raise ValueError(f"LLM: pipeline stage {stage.index} of {stage.size} (decoder layers {stage.layers.start}.."
                         f"{stage.layers.stop - 1}) needs tensors that the model holds only on the meta device: "
                         f"{missing[:8]}{f' and {len(missing) - 8} more' if len(missing) > 8 else ''}")


class StageModel:
    """The part of an inference model (`inference_model.InferenceModel`) that one stage runs, called
    as the runner calls a model: ``(ids, positions, context, rows[, hidden, residual])``. The
    first stage embeds ``ids``; later stages continue from the previous stage's ``hidden`` and
    ``residual``. The last returns the fp32 logits of ``rows``, the others ``(hidden,
    residual)`` for the next stage."""

    def __init__(self, model, stage: PipelineStage) -> None:
        self.model = model
        self.stage = stage

    @property
    def config(self):
        return self.model.config

    def kv_cache_spec(self) -> tuple[int, int, int, int]:
        """The whole model's spec: the runner allocates pages for the stage's layers only."""
        return self.model.kv_cache_spec()

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, context, rows: torch.Tensor,
                 hidden: torch.Tensor | None = None, residual: torch.Tensor | None = None):
        stage = self.stage
        return self.model.forward_stage(stage.layers, stage.is_first, stage.is_last, ids, positions, context, rows,
                                        hidden, residual)
