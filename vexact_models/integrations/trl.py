"""TRL's ``GRPOTrainer``, exactly on-policy: rollouts through `vexact_models.LLM`, training
logprobs through ``token_logprobs``, bitwise equal to the rollout's.

    import vexact_models
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig
    from vexact_models.integrations.trl import VexactGRPOTrainer

    vexact_models.patch()
    model = AutoModelForCausalLM.from_pretrained(path)        # our class (a path string works too)
    trainer = VexactGRPOTrainer(model=model, reward_funcs=reward, args=GRPOConfig(...),
                                train_dataset=dataset, processing_class=tokenizer)
    trainer.train()   # logs sampling/sampling_logp_difference/max = 0, sampling/importance_sampling_ratio/* = 1

`VexactRLOOTrainer` is TRL's ``RLOOTrainer`` with the same rollouts and head (`ExactRolloutsMixin`
holds what the two add to TRL's trainers).

How it plugs in (trl 1.16):

1. **Generation backend.** ``GRPOTrainer`` takes sampler logprobs, recomputes them with the
   training forward, applies its importance-sampling correction and logs
   ``sampling/sampling_logp_difference/{mean,max}`` and
   ``sampling/importance_sampling_ratio/{min,mean,max}`` on its vLLM path. `VexactGRPOTrainer`
   runs that path with `VexactGeneration` in place of TRL's ``VLLMGeneration``: an `LLM` that
   shares the policy's parameters, so there is no weight sync (the optimizer's in-place update is
   what the next rollout samples from). ``GRPOConfig(use_vllm=...)`` must stay False; the
   ``vllm_importance_sampling_*`` options keep their meaning (with exact logprobs the ratio is 1).
2. **Training logprobs.** TRL scores tokens through ``model(..., fused_lm_head=True)``
   (``trl.trainer.utils.add_fused_lm_head``: its own chunked LM-head kernel). The trainer routes
   that call to our forward and ``token_logprobs`` kernel (autocast off, as in the rollout): the
   computation of ``model.token_logprobs``, which equals the rollout's logprobs bitwise. The
   entropy TRL logs (and may mask or regularise with) comes from the same final hidden states.

3. **PEFT.** With ``peft_config=LoraConfig(...)`` (or a ``PeftModel`` over ours) the engine runs the
   PeftModel's own parameters, adapters included (`LLM` reads PEFT's layers), and the head is
   installed on the causal LM the adapters wrap, as TRL installs its own; the reference logprobs
   of ``beta != 0`` (adapters disabled, or TRL's "ref" adapter) come through the same head.
4. **Tools.** TRL's tool loop (``tools=``, ``environment_factory=``) calls `VexactGeneration.generate`
   again with prompt + completion + tool result as token ids: the engine's logprobs of the tokens
   after a tool result are the training forward's too, and TRL masks the result's tokens.

``exact_logprobs=False`` keeps TRL's fused LM head (rollouts still through `LLM`): TRL's metrics
then show the mismatch of its own logprob computation. Not supported (ValueError): LoRA variants
the aligned forward cannot run (DoRA, ...: at the first forward, as for any PeftModel of ours),
``cast_lm_head_to_fp32``, ``use_liger_kernel``, ``repetition_penalty != 1``, ``generation_kwargs`` other than
`GENERATION_KWARGS` (stop strings, ``min_tokens``: the engine gets the trainer's tokenizer), images,
FSDP/DeepSpeed, and a load-balancing loss for DeepSeek-V3/Moonlight (set
``router_aux_loss_coef=0.0``; Qwen3-MoE's is computed from the same forward). ``beta != 0`` uses
TRL's reference model as TRL builds it.
"""

from __future__ import annotations

import functools
import types
from contextlib import nullcontext
from typing import Any

import torch
from accelerate.utils import is_peft_model
from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer

from vexact_models.causal_lm import final_logit_softcap, num_routed_experts
from vexact_models.kernels import token_logprobs
from vexact_models.multimodal import refuse_multimodal_model, text_config_of
from vexact_models.registry import for_model_type
from vexact_models.rl import entropy_rows
from vexact_models.runtime import LLM, SamplingParams

__all__ = ["ExactRolloutsMixin", "VexactGRPOTrainer", "VexactGeneration", "VexactRLOOTrainer", "install_exact_logprobs"]


class VexactGeneration:
    """TRL's generation-backend contract (``VLLMGeneration.generate`` / ``sync_weights``) over a
    vexact-models `LLM`.

    Args:
        llm: the engine. When it shares the policy's parameters (``LLM(policy)``),
            `sync_weights` has nothing to do; otherwise it copies the policy's weights in.
        policy: the training model (unwrapped).
        sampling: keyword arguments of `SamplingParams` for every completion (temperature,
            top_p, top_k, min_p, max_tokens, stop_token_ids; stop strings and min_tokens from TRL's
            ``generation_kwargs``).
    """

    def __init__(self, llm: LLM, policy: torch.nn.Module, sampling: dict[str, Any]) -> None:
        self.llm = llm
        self.policy = policy
        self.sampling = dict(sampling)
        SamplingParams(**self.sampling)  # validate once, before any rollout
        self.last_rollout: tuple[list, list, list] | None = None  # (prompt ids, completion ids, logprobs)

    @property
    def shares_weights(self) -> bool:
        """Whether the engine runs the policy's own parameters (under PEFT: the model the adapters
        wrap, adapters included)."""
        return self.llm.model.causal_lm is causal_lm_of(self.policy)

    def sync_weights(self) -> None:
        """Make the engine sample from the policy's current weights (a no-op when shared)."""
        if not self.shares_weights:
            self.llm.update_weights(self.policy.state_dict())

    def generate(self, prompts: list[list[int]], images=None, num_generations: int = 1, profiler=None):
        """One completion per prompt (TRL repeats each prompt ``num_generations`` times already).

        Returns ``(prompt_ids, completion_ids, logprobs, None)`` in ``VLLMGeneration.generate``'s
        shapes: ``logprobs[i][t]`` is ``[logprob of completion token t]``."""
        if images is not None and any(img is not None for img in images):
            raise ValueError("VexactGeneration.generate: images are not supported (text-only models)")
        params = SamplingParams(n=1, **self.sampling)
        with profiler or nullcontext():
            outputs = self.llm.generate([list(p) for p in prompts], params, use_tqdm=False)
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
    _architecture_of(model)
    head = ExactLogprobHead(model, temperature, entropy_grad)

    @functools.wraps(type(model).forward)  # the class's signature: generate() validates kwargs against it
    def forward(self, *args, **kwargs):
        return head(*args, **kwargs)

    model.forward = types.MethodType(forward, model)
    return head


def causal_lm_of(model: torch.nn.Module) -> torch.nn.Module:
    """`model`, or under PEFT (``PeftModel``) the causal LM its adapters wrap."""
    return model.get_base_model() if is_peft_model(model) else model


def _architecture_of(model):
    refuse_multimodal_model("VexactGRPOTrainer", model)
    arch = for_model_type(getattr(model.config, "model_type", None))
    if arch is None or not isinstance(model, arch.causal_lm_class):
        raise ValueError(f"VexactGRPOTrainer: the model must be a vexact-models causal LM (call vexact_models.patch() "
                         f"before AutoModelForCausalLM.from_pretrained), got {type(model).__module__}."
                         f"{type(model).__name__}")
    return arch


#: the ``GRPOConfig.generation_kwargs`` (vLLM SamplingParams fields) this integration honours
GENERATION_KWARGS = ("stop", "include_stop_str_in_output", "min_tokens")


def _check_config(trainer: str, args, exact_logprobs: bool) -> None:
    """Refuse the settings (a GRPOConfig or an RLOOConfig) this integration cannot honour,
    before anything is built; `trainer` names the class in the message."""
    bad = []
    if args.use_vllm:
        bad.append("use_vllm=True (generation runs on vexact_models.LLM; leave it False)")
    if args.use_transformers_continuous_batching:
        bad.append("use_transformers_continuous_batching=True")
    if args.use_liger_kernel:
        bad.append("use_liger_kernel=True (Liger's kernels would replace the aligned ones the rollout and the training "
                   "forward share)")
    if args.repetition_penalty != 1.0:
        bad.append(f"repetition_penalty={args.repetition_penalty} (LLM has none)")
    other = sorted(set(args.generation_kwargs or {}) - set(GENERATION_KWARGS))
    if other:
        bad.append(f"generation_kwargs {other} (only {list(GENERATION_KWARGS)})")
    if args.temperature <= 0:
        bad.append(f"temperature={args.temperature} (the trainer samples: it must be > 0)")
    if getattr(args, "fsdp", None) or getattr(args, "deepspeed", None):
        bad.append("FSDP/DeepSpeed (the rollout engine needs the full weights in this process)")
    if exact_logprobs and getattr(args, "cast_lm_head_to_fp32", False):
        bad.append("cast_lm_head_to_fp32=True (token_logprobs already computes fp32 logits)")
    if bad:
        raise ValueError(f"{trainer}: unsupported {type(args).__name__} setting(s): " + "; ".join(bad))


def _load_policy(trainer: str, model, args):
    """A path -> our causal LM class for its model_type (TRL would load the stock class); a
    published multimodal checkpoint's text model (`vexact_models.multimodal`)."""
    if not isinstance(model, str):
        return model
    from transformers import AutoConfig
    from trl.trainer.utils import create_model_from_path

    arch = for_model_type(text_config_of(AutoConfig.from_pretrained(model)).model_type)
    if arch is None:
        raise ValueError(f"{trainer}: {model} has a model_type vexact-models does not support")
    return create_model_from_path(model, architecture=arch.causal_lm_class, **dict(args.model_init_kwargs or {}))


def _aux_loss_enabled(model, args) -> bool:
    """Whether TRL's trainer will add an MoE load-balancing loss (its own rule)."""
    config = model.config.get_text_config()
    coef = args.router_aux_loss_coef
    coef = getattr(config, "router_aux_loss_coef", 0.0) if coef is None else coef
    return hasattr(config, "output_router_logits") and coef != 0.0


class ExactRolloutsMixin:
    """What the Vexact trainers add to a TRL trainer with a vLLM backend (``GRPOTrainer``,
    ``RLOOTrainer``): its rollouts from `vexact_models.LLM`, its training logprobs equal to the
    rollout's bitwise. A subclass's ``__init__`` calls `_exact_policy` before TRL's and
    `_use_exact_rollouts` after it."""

    @classmethod
    def _exact_policy(cls, model, args, llm: LLM | None, exact_logprobs: bool):
        """`model` as the trainer should get it (a path loaded as our class), after refusing what
        cannot run exactly (ValueError naming it, before anything is built)."""
        name = cls.__name__
        _check_config(name, args, exact_logprobs)
        if (args.generation_kwargs or {}).get("stop") and llm is not None and llm.tokenizer is None:
            raise ValueError(f"{name}: generation_kwargs['stop'] (stop strings) needs the engine's tokenizer: build the "
                             "llm passed with LLM(..., tokenizer=...)")
        model = _load_policy(name, model, args)
        policy = causal_lm_of(model)
        _architecture_of(policy)
        if exact_logprobs and _aux_loss_enabled(model, args) and getattr(model.config, "num_experts", None) is None:
            raise ValueError(f"{name}: {model.config.model_type} has no load-balancing loss (its routing is "
                             "auxiliary-loss free); set router_aux_loss_coef=0.0")
        if getattr(policy, "generation_config", None) is None:  # TRL's trainers read its pad/EOS ids
            from transformers import GenerationConfig

            policy.generation_config = GenerationConfig.from_model_config(model.config)
        return model

    def _use_exact_rollouts(self, llm: LLM | None, llm_kwargs: dict | None, exact_logprobs: bool,
                            entropy_grad: bool) -> None:
        """Install the exact head (unless `exact_logprobs` is False) and the generation backend."""
        self.exact_logprobs = exact_logprobs
        self.logprob_head = None
        if exact_logprobs:
            # under PEFT on the wrapped causal LM, as TRL installs its own head; PeftModel's forward reaches it
            self.logprob_head = install_exact_logprobs(causal_lm_of(self.model), self.temperature, entropy_grad)
        self._start_generation_backend(llm, llm_kwargs)

    def _start_generation_backend(self, llm: LLM | None, llm_kwargs: dict | None) -> None:
        """Run TRL's vLLM code path (for GRPO: sampler logprobs, recompute, IS correction and its
        metrics) with `VexactGeneration` as the backend."""
        policy = self.accelerator.unwrap_model(self.model)
        if llm is None:
            kw = {"max_num_seqs": self.args.per_device_train_batch_size * self.args.steps_per_generation,
                  "seed": self.args.seed + self.accelerator.process_index}
            if self.accelerator.device.type == "cuda":
                kw["gpu_memory_utilization"] = self.args.vllm_gpu_memory_utilization
            tokenizer = getattr(self.processing_class, "tokenizer", self.processing_class)  # a processor's own
            llm = LLM(policy, **{**kw, "tokenizer": tokenizer, **(llm_kwargs or {})})
        top_k = self.top_k if self.top_k not in (None, 0) else -1
        sampling = {"temperature": self.temperature, "top_p": self.top_p, "top_k": top_k, "min_p": self.min_p or 0.0,
                    "max_tokens": self.max_completion_length, "stop_token_ids": list(self.eos_token_ids),
                    **(self.args.generation_kwargs or {})}
        self.vllm_generation = VexactGeneration(llm, policy, sampling)
        self.use_vllm = True
        self.vllm_mode = "vexact"  # neither "server" nor "colocate": TRL's vLLM-only branches stay off
        self._last_loaded_step = -1

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, **kwargs):
        """TRL's method; the exact head skips the entropy when TRL does not ask for it."""
        if self.logprob_head is None:
            return super()._get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep,
                                                              batch_size, compute_entropy, **kwargs)
        self.logprob_head.want_entropy = compute_entropy
        try:
            return super()._get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep,
                                                              batch_size, compute_entropy, **kwargs)
        finally:
            self.logprob_head.want_entropy = True


class VexactGRPOTrainer(ExactRolloutsMixin, GRPOTrainer):
    """``trl.GRPOTrainer`` whose rollouts come from `vexact_models.LLM` and whose training
    logprobs equal the rollout's bitwise (see the module docstring).

    Takes ``GRPOTrainer``'s arguments, plus:
        llm: an `LLM` to generate with (default: ``LLM(model, **llm_kwargs)``, sharing the
            policy's weights).
        llm_kwargs: `LLM` keyword arguments for the default engine (default: ``max_num_seqs`` =
            the per-process generation batch, ``seed`` = ``args.seed`` + process index, on CUDA
            ``gpu_memory_utilization`` = ``args.vllm_gpu_memory_utilization``).
        exact_logprobs: True (default) computes training logprobs with ``token_logprobs``; False
            keeps TRL's fused LM head (for comparison: then the two differ).
    """

    def __init__(self, model, reward_funcs=None, args: GRPOConfig | None = None, *, llm: LLM | None = None,
                 llm_kwargs: dict | None = None, exact_logprobs: bool = True, **kwargs) -> None:
        if args is None:
            args = GRPOConfig("vexact-grpo")
        model = self._exact_policy(model, args, llm, exact_logprobs)
        super().__init__(model, reward_funcs, args, **kwargs)
        # TRL's entropy bonus differentiates the entropy
        self._use_exact_rollouts(llm, llm_kwargs, exact_logprobs, args.entropy_coef != 0.0 or args.use_adaptive_entropy)


class VexactRLOOTrainer(ExactRolloutsMixin, RLOOTrainer):
    """``trl.RLOOTrainer`` with `VexactGRPOTrainer`'s rollouts and training logprobs: samples
    from the policy's exact distribution, the logprobs TRL recomputes bitwise the rollout's
    (RLOO reads no sampler logprobs). The same extra arguments as `VexactGRPOTrainer`."""

    def __init__(self, model, reward_funcs=None, args: RLOOConfig | None = None, *, llm: LLM | None = None,
                 llm_kwargs: dict | None = None, exact_logprobs: bool = True, **kwargs) -> None:
        if args is None:
            args = RLOOConfig("vexact-rloo")
        model = self._exact_policy(model, args, llm, exact_logprobs)
        super().__init__(model, reward_funcs, args, **kwargs)
        self._use_exact_rollouts(llm, llm_kwargs, exact_logprobs, False)  # (RLOO has no entropy bonus)
