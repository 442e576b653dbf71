"""Load one pipeline stage's share of a checkpoint folder, and nothing else.

The model is built on the meta device (no memory); the stage's modules (`PipelineStage.owns`:
its decoder layers, the embeddings on the first stage, the final norm and the LM head on the
last) are then given storage on the stage's device and filled from the safetensors files
(single file, or sharded with ``model.safetensors.index.json``), reading only the tensors
they need (``safe_open`` maps the files; the headers say where each tensor is). Every other
parameter stays on the meta device. The values and dtypes are those ``from_pretrained`` gives:
the checkpoint's tensors cast to the load dtype, except what the class keeps in fp32
(``_keep_in_fp32_modules_strict``, e.g. DeepSeek-V3's expert-selection bias), and MoE
experts stored one tensor per expert (the hub layout, Qwen's and DeepSeek's names or Mixtral's,
``block_sparse_moe.experts.{e}.w1/w3/w2``, which MiniMax-M2 keeps) are fused into HF's 3-D tensors
as transformers' own conversion does (``gate_up_proj[e] = cat(gate_proj, up_proj)``, gate first);
an MXFP4 weight (``<name>_blocks`` and ``<name>_scales``, published GPT-OSS) is dequantized as
``Mxfp4Config(dequantize=True)`` does (`vexact_models.mxfp4.dequantize_mxfp4`: the same bits).
Of a published multimodal checkpoint (Qwen3.5, Gemma 3) the text model's tensors are read under
their stored names and the rest is skipped (`model_tensor_names`).
"""

from __future__ import annotations

import os
import re

import torch
from torch import nn
from transformers import GenerationConfig

from vexact_models.hub_config import TensorReader, source_config_dict, stored_tensors
from vexact_models.multimodal import is_multimodal, tell_text_part, text_tensor_name
from vexact_models.mxfp4 import BLOCKS, SCALES, dequantize_mxfp4

from .pipeline import PipelineStage

__all__ = ["empty_stage_model", "load_stage_model"]

_FUSED_EXPERTS = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<kind>gate_up_proj|down_proj)$")
# one tensor per expert as the hub stores them: (gate, up, down) projections' names, Qwen's and
# DeepSeek's, then Mixtral's (w1, w3, w2), which MiniMax-M2 keeps along with the MoE block's name
_PER_EXPERT = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))
_MIXTRAL_BLOCK = (".mlp.", ".block_sparse_moe.")
_LIST_AT_MOST = 8


def model_tensor_names(folder: str, stored: list[str]) -> dict[str, str]:
    """The model's name -> the stored name, of the checkpoint in `folder`: the same names, or of a
    published multimodal checkpoint its text model's tensors renamed and the rest left out
    (`vexact_models.multimodal`, as ``from_pretrained`` loads it)."""
    full = source_config_dict(folder, {})
    if not is_multimodal(full):
        return {name: name for name in stored}
    tell_text_part("LLM", folder, full["model_type"])
    renamed = {name: text_tensor_name(name) for name in stored}
    return {text: name for name, text in renamed.items() if text is not None}


class _Reader:
    """Reads single tensors out of a checkpoint's safetensors files, each file opened once, by
    the model's names (`model_tensor_names`)."""

    def __init__(self, folder: str) -> None:
        self.reader = TensorReader(stored_tensors(folder, "LLM (pipeline stages load safetensors only)"))
        self.stored = model_tensor_names(folder, list(self.reader.files))

    def __contains__(self, name: str) -> bool:
        return name in self.stored or (name + BLOCKS in self.stored and name + SCALES in self.stored)

    def get(self, name: str) -> torch.Tensor:
        """The tensor `name`; an MXFP4 pair's weight dequantized (exact in bf16: `dequantize_mxfp4`)."""
        if name not in self.stored:
            return dequantize_mxfp4(self._stored(name + BLOCKS), self._stored(name + SCALES))
        return self._stored(name)

    def _stored(self, name: str) -> torch.Tensor:
        return self.reader.get(self.stored[name])


def _keep_fp32(model: nn.Module, dtype: torch.dtype) -> list[str]:
    """Name fragments transformers keeps in fp32 when loading in `dtype` (its ``_get_dtype_plan``)."""
    keep = []
    if dtype == torch.float16:
        keep += list(getattr(model, "_keep_in_fp32_modules", None) or [])
    if dtype in (torch.float16, torch.bfloat16):
        keep += list(getattr(model, "_keep_in_fp32_modules_strict", None) or [])
    return keep


def _materialize(model: nn.Module, stage: PipelineStage, device: torch.device, dtype: torch.dtype) -> dict:
    """Give the stage's parameters and buffers storage on `device` (uninitialised), in their load
    dtype; returns them by checkpoint name. Tied weights stay tied (one tensor)."""
    keep = _keep_fp32(model, dtype)
    # a tied LM head is the embedding matrix: the last stage holds it under both names
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    owned: dict[str, torch.Tensor] = {}
    made: dict[int, torch.Tensor] = {}  # id(meta tensor) -> its new tensor: ties stay ties
    for kind in ("parameters", "buffers"):
        for name, tensor in getattr(model, f"named_{kind}")(remove_duplicate=False):
            if not (stage.owns(name) or tied and stage.is_last and name == "model.embed_tokens.weight"):
                continue
            if id(tensor) not in made:
                want = torch.float32 if any(k in name for k in keep) else tensor.dtype
                new = torch.empty(tensor.shape, dtype=want, device=device)
                made[id(tensor)] = nn.Parameter(new, requires_grad=tensor.requires_grad) if kind == "parameters" else new
            module_name, _, leaf = name.rpartition(".")
            module = model.get_submodule(module_name)
            getattr(module, f"_{kind}")[leaf] = made[id(tensor)]
            owned[name] = made[id(tensor)]
    return owned


def _fill(owned: dict[str, torch.Tensor], reader: _Reader, folder: str) -> None:
    """Copy every owned tensor's value from the checkpoint (cast to its dtype); ValueError
    naming every tensor the checkpoint lacks or holds in another shape."""
    missing, wrong, done = [], [], set()
    for name, target in owned.items():
        if id(target) in done:
            continue
        sources = _sources(name, target, reader)
        if sources is None:
            missing.append(name)
            continue
        for rows, source in sources:
            value = reader.get(source)
            if tuple(value.shape) != tuple(target[rows].shape):
                wrong.append(f"{source} has shape {tuple(value.shape)} but the model expects {tuple(target[rows].shape)}")
                break
            with torch.no_grad():
                target[rows].copy_(value)
        done.add(id(target))
    for problems, what in ((missing, "is missing tensor(s)"), (wrong, "has tensor(s) that do not fit the config:")):
        if problems:
            more = f" and {len(problems) - _LIST_AT_MOST} more" if len(problems) > _LIST_AT_MOST else ""
            raise ValueError(f"LLM: the checkpoint {folder} {what} {problems[:_LIST_AT_MOST]}{more}")


def _sources(name: str, target: torch.Tensor, reader: _Reader) -> list[tuple[tuple, str]] | None:
    """``[(index into target, checkpoint tensor name)]`` that fill `target`, or None when the
    checkpoint lacks them: the tensor itself (or under Mixtral's MoE block name), the tied head's
    embedding, or one tensor per expert (gate and up rows of ``gate_up_proj``, ``down_proj``)."""
    whole = (slice(None),)
    for stored in (name, name.replace(*_MIXTRAL_BLOCK)):
        if stored in reader:
            return [(whole, stored)]
    if name == "lm_head.weight" and "model.embed_tokens.weight" in reader:
        return [(whole, "model.embed_tokens.weight")]
    if name == "model.embed_tokens.weight" and "lm_head.weight" in reader:
        return [(whole, "lm_head.weight")]
    match = _FUSED_EXPERTS.match(name)
    if match is None:
        return None
    experts, inter = target.shape[0], target.shape[1] // 2
    for prefix in (match["prefix"], match["prefix"].replace(*_MIXTRAL_BLOCK)):
        for gate, up, down in _PER_EXPERT:
            if match["kind"] == "down_proj":
                parts = [((e,), f"{prefix}.{e}.{down}.weight") for e in range(experts)]
            else:
                parts = [part for e in range(experts) for part in (((e, slice(0, inter)), f"{prefix}.{e}.{gate}.weight"),
                                                                   ((e, slice(inter, None)), f"{prefix}.{e}.{up}.weight"))]
            if all(source in reader for _, source in parts):
                return parts
    return None


def empty_stage_model(arch, config, dtype: torch.dtype, stage: PipelineStage | None, device: torch.device):
    """The training-variant model of `arch` for `config` holding only `stage`'s tensors (all of
    them when `stage` is None), on `device` in `dtype` (what the class keeps in fp32 in fp32),
    uninitialised; the rest on the meta device. For an engine whose weights come from a trainer
    (``LLM(model, pipeline_parallel_size=P, owns_weights=True)``, then ``update_weights``);
    buffers (e.g. DeepSeek-V3's expert-selection bias) are not parameters: set them too."""
    if stage is None:
        layers = int(config.num_hidden_layers)
        stage = PipelineStage(0, 1, range(layers), layers)
    with torch.device("meta"):
        model = arch.causal_lm_class._from_config(config, dtype=dtype)
    _materialize(model, stage, device, dtype)
    return model.eval()


def load_stage_model(folder: str, arch, config, dtype: torch.dtype, stage: PipelineStage, device: torch.device):
    """The training-variant model of `arch` for `config`, holding only `stage`'s tensors (on
    `device`, loaded from the checkpoint in `folder` in `dtype`); the rest on the meta device.
    Its ``generation_config`` is the folder's ``generation_config.json`` when there is one."""
    with torch.device("meta"):
        model = arch.causal_lm_class._from_config(config, dtype=dtype)
    owned = _materialize(model, stage, device, dtype)
    _fill(owned, _Reader(folder), folder)
    if os.path.isfile(os.path.join(folder, "generation_config.json")):
        model.generation_config = GenerationConfig.from_pretrained(folder)
    return model.eval()
