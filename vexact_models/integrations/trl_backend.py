"""What TRL's trainers run on, for `vexact_models.integrations.trl`'s trainers: the generation
backend over a vexact-models `LLM` (`VexactGeneration`, TRL's ``VLLMGeneration`` contract) and
the exact logprob head answering TRL's fused-LM-head call (`install_exact_logprobs`)."""

from __future__ import annotations

import functools
import types
from contextlib import nullcontext
from typing import Any

import torch
from accelerate.utils import is_peft_model

from vexact_models.adapter_weights import adapter_tensors
from vexact_models.causal_lm import final_logit_softcap, num_routed_experts
from vexact_models.kernels import token_logprobs
from vexact_models.multimodal import refuse_multimodal_model
from vexact_models.registry import for_model_type
from vexact_models.rl import entropy_rows
from vexact_models.runtime import LLM, SamplingParams

__all__ = ["ExactLogprobHead", "VexactGeneration", "causal_lm_of", "install_exact_logprobs", "policy_architecture"]


class VexactGeneration:
    """TRL's generation-backend contract (``VLLMGeneration.generate`` / ``sync_weights``) over a
    vexact-models `LLM`.

    Args:
        llm: the engine. When it shares the policy's parameters (``LLM(policy)``),
            `sync_weights` has nothing to do; otherwise it copies the policy's weights in.
        policy: the training model (unwrapped).
        sampling: keyword arguments of `SamplingParams` for every completion (temperature,
            top_p, top_k, min_p, repetition_penalty, max_tokens, stop_token_ids; stop strings,
            min_tokens and the other penalties from TRL's ``generation_kwargs``).
    """

    def __init__(self, llm: LLM, policy: torch.nn.Module, sampling: dict[str, Any]) -> None:
        self.llm = llm
        self.policy = policy
        self.sampling = dict(sampling)
        SamplingParams(**self.sampling)  # validate once, before any rollout
        self.last_rollout: tuple[list, list, list] | None = None  # (prompt ids, completion ids, logprobs)
        if is_peft_model(policy) and not self.shares_weights and not adapter_tensors(llm.model.causal_lm):
            raise ValueError("VexactGeneration: the policy is a PEFT model and the engine (llm=) holds no adapters, so "
                             "it cannot sample what the policy trains; build it over the PEFT model (LLM(peft_model, "
                             "...)) or leave llm= unset to share the policy's weights")

    @property
    def shares_weights(self) -> bool:
        """Whether the engine runs the policy's own parameters (under PEFT: the model the adapters
        wrap, adapters included)."""
        return self.llm.model.causal_lm is causal_lm_of(self.policy)

    def sync_weights(self) -> None:
        """Make the engine sample from the policy's current weights (a no-op when shared). Under
        PEFT the frozen base stays: the adapters (into the engine's own, written exactly:
        `LLM.update_weights`) and any other trainable parameter (PEFT's ``bias``) are sent;
        otherwise the whole state dict."""
        if self.shares_weights:
            return
        if not is_peft_model(self.policy):
            self.llm.update_weights(self.policy.state_dict())
            return
        model = causal_lm_of(self.policy)
        adapters = adapter_tensors(model)
        sent = {id(t.param) for t in adapters}
        trained = [(n, p.detach()) for n, p in model.named_parameters() if p.requires_grad and id(p) not in sent]
        self.llm.update_weights([(t.name, t.param.detach()) for t in adapters] + trained)

    def generate(self, prompts: list[list[int]], images=None, num_generations: int = 1, profiler=None):
        """One completion per prompt (TRL repeats each prompt ``num_generations`` times already).

        Returns ``(prompt_ids, completion_ids, logprobs, None)`` in ``VLLMGeneration.generate``'s
        shapes: ``logprobs[i][t]`` is ``[logprob of completion token t]``."""
        if images is not None and any(img is not None for img in images):
            raise ValueError("VexactGeneration.generate: images are not supported (text-only models)")
        params = SamplingParams(n=1, **self.sampling)
        with profiler or nullcontext():
            outputs = self.llm.generate([list(p) for p in prompts], params, use_tqdm=False)
        for out in outputs:  # a row the settings left no token (allowed_token_ids, min_tokens, a grammar): not data
            for c in out.outputs:
                if c.finish_reason == "error":
                    raise RuntimeError(f"VexactGeneration.generate: request {out.request_id}: {c.error}")
        prompt_ids = [out.prompt_token_ids for out in outputs]
        completion_ids = [out.outputs[0].token_ids for out in outputs]
        logprobs = [out.outputs[0].logprobs for out in outputs]
        self.last_rollout = (prompt_ids, completion_ids, logprobs)
        return prompt_ids, completion_ids, [[[lp] for lp in seq] for seq in logprobs], None


class ExactLogprobHead:
    """Replaces ``model.forward`` so that TRL's ``model(..., labels=labels, fused_lm_head=True)``
    returns logprobs from `vexact_models.kernels.token_logprobs` (see `install_exact_logprobs`);
    other calls go to the forward it replaced."""

    def __init__(self, model: torch.nn.Module, temperature: float, entropy_grad: bool) -> None:
        self.model = model
        self.temperature = float(temperature)
        self.entropy_grad = entropy_grad  # TRL's entropy bonus differentiates the entropy
        self.want_entropy = True
        self.previous_forward = model.forward

    def __call__(self, *args, fused_lm_head: bool = False, labels=None, shift_labels=None, num_items_in_batch=None,
                 **kwargs):
        if not fused_lm_head:
            extra = {k: v for k, v in (("labels", labels), ("shift_labels", shift_labels),
                                       ("num_items_in_batch", num_items_in_batch)) if v is not None}
            return self.previous_forward(*args, **kwargs, **extra)
        from trl.trainer.utils import FusedCausalLMOutput

        kwargs = {k: v for k, v in kwargs.items() if v is not None}  # PEFT's forward passes its unset arguments
        input_ids = kwargs.pop("input_ids", args[0] if args else None)
        attention_mask = kwargs.pop("attention_mask", None)
        want_router = bool(kwargs.pop("output_router_logits", False))
        if kwargs or len(args) > 1:
            raise ValueError(f"exact logprobs: unsupported model inputs {sorted(kwargs) or 'positional'} "
                             "(text-only input_ids/attention_mask)")
        if shift_labels is not None:
            raise ValueError("exact logprobs: pre-shifted labels (context/sequence parallelism) are not supported")
        mask = labels[:, 1:] != -100  # TRL's layout: entry t scores token t + 1
        # autocast off: the kernels run exactly as in the rollout whatever the trainer's mixed precision
        with torch.autocast(input_ids.device.type, enabled=False):
            hidden, aux_loss = self._final_hidden(input_ids, attention_mask, want_router)
            rows = hidden[:, :-1][mask]  # only the scored positions: no lm_head work on prompts or padding
            weight, softcap = _lm_head_weight(self.model), final_logit_softcap(self.model.config)
            # the kernel `model.token_logprobs` and the sampler use: per row, so bitwise the rollout's value
            lp = token_logprobs(rows, weight, labels[:, 1:][mask], self.temperature, softcap=softcap)
            entropy = None
            if self.want_entropy:
                with nullcontext() if self.entropy_grad else torch.no_grad():
                    entropy = mask.new_zeros(mask.shape, dtype=torch.float32).masked_scatter(
                        mask, entropy_rows(rows, weight, self.temperature, softcap))
        log_probs = lp.new_zeros(mask.shape).masked_scatter(mask, lp)
        if not mask.any():  # an all-masked micro-batch still backpropagates (a connected zero, as in TRL's head)
            log_probs = log_probs + 0.0 * hidden[:, :-1].sum(-1)
        denominator = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
        loss = -log_probs.sum() / denominator
        if aux_loss is not None:
            loss = loss + (getattr(self.model.config, "router_aux_loss_coef", 0.0) or 0.0) * aux_loss
        return FusedCausalLMOutput(loss=loss, log_probs=log_probs, entropy=entropy, label_mask=mask,
                                   aux_loss=aux_loss)

    def _final_hidden(self, input_ids, attention_mask, want_router: bool):
        """Final hidden states in the input's shape and, when asked, the MoE load-balancing loss of
        the same forward (HF's ``load_balancing_loss_func`` over the real tokens' router logits, as
        our Qwen3-MoE ``forward`` computes it)."""
        base = self.model.model
        if not want_router:
            return base(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state, None
        from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

        router: list = []
        hidden, flat, _ = base.forward_hf_inputs(input_ids, attention_mask, router_logits=router)
        config = self.model.config
        aux_loss = load_balancing_loss_func(tuple(router), num_routed_experts(config), config.num_experts_per_tok, None)
        return flat.to_padded(hidden), aux_loss


def _lm_head_weight(model) -> torch.Tensor:
    getter = getattr(model, "lm_head_weight", None)  # our accessor (PEFT's modules_to_save copy when active)
    return getter() if callable(getter) else model.lm_head.weight


def install_exact_logprobs(model: torch.nn.Module, temperature: float, entropy_grad: bool = False) -> ExactLogprobHead:
    """Answer TRL's fused-LM-head call (``model(..., fused_lm_head=True)``) on `model`, one of our
    causal LMs, as ``model.token_logprobs`` would at `temperature` (its kernel on the model's final
    hidden states), plus TRL's entropy and MoE load-balancing loss. Call it after TRL's
    ``add_fused_lm_head`` (which ``GRPOTrainer.__init__`` applies). Returns the installed head."""
    policy_architecture(model)
    head = ExactLogprobHead(model, temperature, entropy_grad)

    @functools.wraps(type(model).forward)  # the class's signature: generate() validates kwargs against it
    def forward(self, *args, **kwargs):
        return head(*args, **kwargs)

    model.forward = types.MethodType(forward, model)
    return head


def causal_lm_of(model: torch.nn.Module) -> torch.nn.Module:
    """`model`, or under PEFT (``PeftModel``) the causal LM its adapters wrap."""
    return model.get_base_model() if is_peft_model(model) else model


def policy_architecture(model, caller: str = "VexactGRPOTrainer"):
    """The registered architecture of `model`, one of our causal LMs; ValueError naming `caller`
    and the class it got otherwise (a stock or a multimodal model)."""
    refuse_multimodal_model(caller, model)
    arch = for_model_type(getattr(model.config, "model_type", None))
    if arch is None or not isinstance(model, arch.causal_lm_class):
        raise ValueError(f"{caller}: the model must be a vexact-models causal LM (call vexact_models.patch() "
                         f"before AutoModelForCausalLM.from_pretrained), got {type(model).__module__}."
                         f"{type(model).__name__}")
    return arch
