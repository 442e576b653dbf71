"""HF's generation entry points on our causal LMs: ``generate`` over a KV cache of our own
(`vexact_models.generation`) and transformers' continuous-batching ``generate_batch`` run by the
rollout engine (`vexact_models.batch_generation`)."""

from __future__ import annotations

import torch

from vexact_models import batch_generation
from vexact_models.forward_arguments import CACHE_ARGUMENTS
from vexact_models.generation import cached_steps, generate_arguments

__all__ = ["GenerationMethodsMixin"]


class GenerationMethodsMixin:
    """Mixed into `causal_lm.CausalLMMixin`, before HF's ``GenerationMixin`` in each causal LM's
    bases, whose methods these wrap or replace."""

    def generate(self, *args, **kwargs):
        """HF's ``GenerationMixin.generate`` over a KV cache of our own (`vexact_models.generation`):
        each step runs only the tokens it adds through the paged forward the rollouts run, so the
        logits, and greedy output, equal the whole recompute's and `vexact_models.LLM`'s bit for
        bit. ``use_cache=False`` and beam search recompute the whole sequence each step. Every
        decoding mode HF runs without its own cache runs as HF's; assisted decoding
        (``assistant_model``, ``prompt_lookup_num_tokens``, ...) is a ValueError. With
        ``output_hidden_states`` each step's states cover the whole sequence (that step is a whole
        recompute), as stock's do with ``use_cache=False``. One eager forward per step: roll out
        with `vexact_models.LLM`, which shares this model's weights. HF's
        ``cache_implementation="paged"`` switches to `generate_batch`, which the engine runs."""
        if kwargs.get("cache_implementation") == "paged":  # HF's switch to generate_batch
            return super().generate(*args, **kwargs)
        args, kwargs, cached = generate_arguments(self, args, kwargs)
        with cached_steps(self, cached):
            return super().generate(*args, **kwargs)

    def prepare_inputs_for_generation(self, input_ids: torch.LongTensor, *args, attention_mask: torch.Tensor | None = None,
                                      inputs_embeds: torch.Tensor | None = None, **kwargs) -> dict:
        """HF's step inputs; for a prompt given as ``inputs_embeds``, every step after the first
        feeds the prompt's embeddings followed by the generated tokens' (HF feeds only the new
        tokens, relying on a KV cache this model does not keep), matching the full
        ``attention_mask``, so padded prompts generate as with a cache. The steps get no cache
        (HF makes one for an ``inputs_embeds`` prompt): the forward would refuse it once it has
        been left empty (`forward_arguments.refuse_kv_prefix`)."""
        inputs = super().prepare_inputs_for_generation(input_ids, *args, attention_mask=attention_mask,
                                                        inputs_embeds=inputs_embeds, **kwargs)
        for name in CACHE_ARGUMENTS:
            inputs.pop(name, None)
        prompt, mask = inputs_embeds, attention_mask
        if inputs.get("inputs_embeds") is None and prompt is not None and mask is not None \
                and mask.shape[-1] > prompt.shape[1]:
            new = input_ids[:, prompt.shape[1] - mask.shape[-1]:]  # the generated tokens (input_ids may hold the prompt)
            inputs["inputs_embeds"] = torch.cat([prompt, self.get_input_embeddings()(new).to(prompt.dtype)], dim=1)
            inputs["input_ids"] = None
            positions = inputs.get("position_ids")
            if positions is not None and positions.shape[-1] != mask.shape[-1]:  # sliced to the new tokens
                del inputs["position_ids"]  # the mask gives them: each row counts from its first token
        return inputs

    def generate_batch(self, inputs: list[list[int]], generation_config=None, continuous_batching_config=None,
                       record_timestamps: bool = False, progress_bar: bool = False, persistent_manager: bool = False,
                       warmup: bool = True, **kwargs) -> dict:
        """transformers' continuous-batching ``generate_batch`` (``{request_id: GenerationOutput}``
        in stock's order), run by a `vexact_models.LLM` over this model's parameters: the
        tokens, and with ``return_logprobs`` each logprob, are the engine's, bitwise what
        `token_logprobs` recomputes. The ``GenerationConfig`` is read as stock's continuous
        batching reads it; a setting the engine's sampler has no counterpart for is a ValueError
        naming it (`batch_generation`)."""
        return batch_generation.generate_batch(
            self, inputs, generation_config, continuous_batching_config, record_timestamps=record_timestamps,
            progress_bar=progress_bar, persistent_manager=persistent_manager, warmup=warmup, **kwargs)

    def destroy_cached_continuous_batching_manager(self) -> None:
        """Free the engine ``generate_batch(persistent_manager=True)`` kept."""
        batch_generation.drop_engine(self)

    def init_continuous_batching(self, *args, **kwargs):
        """Refused: transformers' streaming manager runs its own paged attention
        (`batch_generation.refuse_streaming_manager`)."""
        batch_generation.refuse_streaming_manager(self, "init_continuous_batching")

    def continuous_batching_context_manager(self, *args, **kwargs):
        """Refused, as `init_continuous_batching`."""
        batch_generation.refuse_streaming_manager(self, "continuous_batching_context_manager")
