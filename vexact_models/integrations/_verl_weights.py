"""verl's weight sync into the rollout's engine (`VexactRollout`'s ``update_weights``): the
trainer's full tensors, or with unmerged LoRA its adapters alone, streamed into the engine's
parameters (verl's per-expert MoE tensors fused back, persistent buffers copied)."""

from __future__ import annotations

import torch

from vexact_models.integrations._verl_support import (ExpertRefuser, add_adapters, copy_buffers, engine_pairs,
                                                      lora_fields, plain_name, refuse_experts)

__all__ = ["RolloutWeights"]


class RolloutWeights:
    """`update_weights` over the rollout's ``llm``, for `VexactRollout` (its ``_lora`` notes the
    adapters the engine holds; ``global_steps`` the step the weights are of)."""

    _lora: dict | None
    global_steps: int | None

    async def update_weights(self, weights, wire_format: str = "named_tensors", global_steps: int | None = None,
                             peft_config=None, **kwargs) -> None:
        """Copy the trainer's tensors into the engine, consuming `weights` (a sync or async
        stream of ``(name, tensor)``, verl's per-expert MoE names included) lazily, never
        holding a second copy of the model. With `peft_config` (verl's unmerged LoRA: its
        adapters alone, or once its base with LoRA's ``base_layer`` names) the engine's model
        takes LoRA adapters of that config first (`_verl_support.add_adapters`); a later config
        that differs is a ValueError naming the field, before anything is written."""
        if wire_format != "named_tensors":
            raise ValueError(f"update_weights: wire_format={wire_format!r} is not supported (only 'named_tensors'); "
                             "use checkpoint_engine.backend=naive or nccl")
        llm = self.llm
        model = llm.model.causal_lm
        adapter_dtype = None if peft_config is None else self._hold_adapters(model, lora_fields(peft_config))
        # by their names without LoRA's base_layer (verl's per-expert tensors name none, its base
        # sync one, PEFT's nested expert wrappers two); `engine_pairs` puts the engine's back
        params = {plain_name(n): (n, p) for n, p in model.named_parameters()}
        names, shapes = {k: n for k, (n, _) in params.items()}, {k: p.shape for k, (_, p) in params.items()}
        buffers = {plain_name(n): b for n, b in model.named_buffers()}
        # no_grad around synchronous stretches only: across an await it would leak to other coroutines
        if hasattr(weights, "__aiter__"):  # a checkpoint engine's receiver
            refuser = ExpertRefuser(shapes)
            async for name, tensor in weights:
                with torch.no_grad():
                    ready = list(engine_pairs(copy_buffers(refuser.push(name, tensor), buffers), names, adapter_dtype))
                    if ready:
                        llm.update_weights(ready)
            refuser.close()
        else:
            with torch.no_grad():
                llm.update_weights(engine_pairs(copy_buffers(refuse_experts(weights, shapes), buffers), names,
                                                adapter_dtype))
        if global_steps is not None:
            self.global_steps = global_steps

    def _hold_adapters(self, model: torch.nn.Module, fields: dict) -> torch.dtype:
        """Give the engine's `model` the adapters of `fields` (once; later calls must name the
        same config); returns their dtype."""
        if self._lora is None:
            add_adapters(model, fields)
            self._lora = fields
        elif fields != self._lora:
            changed = sorted(k for k in set(fields) | set(self._lora) if fields.get(k) != self._lora.get(k))
            raise ValueError(f"update_weights: peft_config differs from the adapters the engine holds in {changed} "
                             f"(now {[fields.get(k) for k in changed]}, held {[self._lora.get(k) for k in changed]})")
        return next(p.dtype for n, p in model.named_parameters() if "lora_" in n)
