"""Building the rollout engine: `LLM`'s device, model and KV-cache size.

A mixin of `runtime.llm.LLM` (it sets and reads the engine's ``device``, ``model``, ``config``,
``dtype``, ``pipeline`` and ``tokenizer``), kept apart so that each file holds one concept:
serving requests there, what the engine is built from here (a checkpoint folder or a model
instance, on one process or as one stage of a pipeline, `runtime.pipeline`).
"""

from __future__ import annotations

import os

import torch
from transformers import AutoConfig, AutoTokenizer

from vexact_models.registry import for_model_type

from .model_runner import kv_bytes_per_block
from .pipeline import PipelineStage, StageModel
from .pipeline_load import load_stage_model


class EngineSetupMixin:
    """Construction helpers of `LLM`."""

    @staticmethod
    def _pick_device(model, device: torch.device | None, stage: PipelineStage | None) -> torch.device:
        if device is not None:
            return device
        if isinstance(model, torch.nn.Module):  # a model instance: run where its (stage's) layers live
            layers = model.get_base_model().model.layers if hasattr(model, "get_base_model") else model.model.layers
            return next(layers[0 if stage is None else stage.layers[0]].parameters()).device
        if not torch.cuda.is_available():
            return torch.device("cpu")
        # a stage's tensors and NCCL messages live on the device torch.cuda.set_device chose
        return torch.device("cuda", torch.cuda.current_device()) if stage is not None else torch.device("cuda")

    def _runner_model(self) -> tuple:
        """What the runner runs: the inference model, or this pipeline stage's part of it, with
        the stage's decoder layers (whose KV pages it holds) and the width of the hidden rows
        it takes from the previous stage (0: it takes token ids)."""
        if self.pipeline is None:
            return self.model, None, 0
        stage = self.pipeline.stage
        return StageModel(self.model, stage), stage.layers, 0 if stage.is_first else self.config.hidden_size

    @staticmethod
    def _folder_config(path: str):
        """A checkpoint folder's HF config and the registered architecture serving it."""
        config = AutoConfig.from_pretrained(path)
        arch = for_model_type(config.model_type)
        if arch is None:
            raise ValueError(f"LLM: {path} has model_type {config.model_type!r}, which vexact-models does not support")
        return config, arch

    def _load(self, path: str, dtype, stage: PipelineStage | None):
        """The training model of a checkpoint folder (a pipeline stage: only its tensors,
        `pipeline_load`), and its tokenizer when the folder has one."""
        config, arch = self._folder_config(path)
        if dtype == "auto":
            torch_dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
        else:
            torch_dtype = dtype
        if isinstance(torch_dtype, str):
            torch_dtype = getattr(torch, torch_dtype)
        if stage is not None:
            model = load_stage_model(path, arch, config, torch_dtype, stage, self.device)
        else:
            model = arch.causal_lm_class.from_pretrained(path, dtype=torch_dtype).to(self.device).eval()
        if any(os.path.exists(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
            self.tokenizer = AutoTokenizer.from_pretrained(path)
        return model

    def _num_blocks(self, block_size: int, utilization: float, kv_cache_bytes: int | None) -> int:
        """KV pages that fit the budget (a pipeline stage's budget holds its layers' pages; every
        stage takes the smallest count, since the first stage's page ids address them all)."""
        spec = self.model.kv_cache_spec()
        per_block = kv_bytes_per_block(spec, block_size, self.dtype)
        if self.pipeline is not None:  # this stage's layers' share (pages hold every layer alike)
            per_block = per_block // spec[0] * len(self.pipeline.stage.layers)
        if kv_cache_bytes is None:
            if self.device.type == "cuda":
                torch.cuda.empty_cache()  # memory the allocator holds unused is the budget's too
                free, total = torch.cuda.mem_get_info(self.device)
                kv_cache_bytes = int(free - (1 - utilization) * total)
            else:
                kv_cache_bytes = 256 << 20
        blocks = kv_cache_bytes // per_block
        if self.pipeline is not None:  # before any raise: every stage must reach this collective
            blocks = self.pipeline.comm.min_over_stages(blocks)
        if blocks < 1:
            raise ValueError(f"LLM: the KV cache budget ({kv_cache_bytes} bytes) is smaller than one block "
                             f"({per_block} bytes); raise kv_cache_bytes or gpu_memory_utilization")
        return int(blocks)

    def _eos_ids(self) -> list[int]:
        """The checkpoint's EOS ids: its generation_config.json (which from_pretrained loads into
        the model, e.g. Qwen3's <|im_end|> and <|endoftext|>), else config.eos_token_id."""
        gen = getattr(self.model.causal_lm, "generation_config", None)
        eos = getattr(gen, "eos_token_id", None) if gen is not None else None
        if eos is None:
            eos = getattr(self.config, "eos_token_id", None)
        ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        vocab = int(self.config.vocab_size)
        bad = [i for i in ids if not 0 <= int(i) < vocab]
        if bad:  # the sampler would index its stop-token mask out of range, mid-step
            raise ValueError(f"LLM: eos_token_id {bad} (generation_config / config.eos_token_id) is outside the "
                             f"vocabulary [0, {vocab}); fix the checkpoint's eos_token_id")
        return ids
