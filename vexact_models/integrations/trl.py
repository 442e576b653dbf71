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

`VexactRLOOTrainer` is TRL's ``RLOOTrainer`` with the same rollouts and head, and
`VexactDistillationTrainer` TRL's ``DistillationTrainer`` (on-policy distillation) with the
student's samples from the engine (`ExactRolloutsMixin` holds what they add to TRL's trainers;
the backend and the head are in `trl_backend`).

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
   after a tool result are the training forward's too, and TRL masks the result's tokens (GRPO's
   and on-policy distillation's loops alike: tests/integrations/test_trl_tools.py).

``exact_logprobs=False`` keeps TRL's fused LM head (rollouts still through `LLM`): TRL's metrics
then show the mismatch of its own logprob computation. Not supported (ValueError): LoRA variants
the aligned forward cannot run (DoRA, ...: at the first forward, as for any PeftModel of ours),
``cast_lm_head_to_fp32``, ``use_liger_kernel``, ``generation_kwargs`` other than `GENERATION_KWARGS` (stop
strings, ``min_tokens``, the penalties, the filters, ``allowed_token_ids``, ``logit_bias``,
``ignore_eos``, ``skip_special_tokens``, ``bad_words``, ``structured_outputs``, which
``vllm_structured_outputs_regex`` sets too: the
engine gets the trainer's tokenizer; fields that would change what training recomputes, such as
``temperature`` or ``logprobs``, are refused), images,
FSDP/DeepSpeed, and a load-balancing loss for DeepSeek-V3/Moonlight (set
``router_aux_loss_coef=0.0``; Qwen3-MoE's is computed from the same forward). ``beta != 0`` uses
TRL's reference model as TRL builds it.
"""

from __future__ import annotations

from trl import DistillationConfig, DistillationTrainer, GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer

from vexact_models.multimodal import text_config_of
from vexact_models.registry import for_model_type
from vexact_models.runtime import LLM
from vexact_models.runtime.linear_state_cache import linear_state_spec

from .trl_backend import VexactGeneration, causal_lm_of, install_exact_logprobs, policy_architecture

__all__ = ["ExactRolloutsMixin", "VexactDistillationTrainer", "VexactGRPOTrainer", "VexactGeneration", "VexactRLOOTrainer",
           "install_exact_logprobs"]


#: the ``GRPOConfig.generation_kwargs`` (vLLM SamplingParams fields) this integration honours
GENERATION_KWARGS = ("stop", "include_stop_str_in_output", "min_tokens", "repetition_penalty", "frequency_penalty",
                     "presence_penalty", "top_k", "top_p", "min_p", "allowed_token_ids", "logit_bias", "ignore_eos",
                     "skip_special_tokens", "spaces_between_special_tokens", "structured_outputs", "bad_words")
#: of those, the ones that change only vLLM's output text, which TRL does not read (it decodes the ids): dropped
TEXT_ONLY_KWARGS = ("spaces_between_special_tokens",)


def _check_config(trainer: str, args, exact_logprobs: bool) -> None:
    """Refuse the settings (TRL's GRPOConfig, RLOOConfig or DistillationConfig) this integration
    cannot honour, before anything is built; `trainer` names the class in the message."""
    bad = []
    if args.use_vllm:
        bad.append("use_vllm=True (generation runs on vexact_models.LLM; leave it False)")
    if getattr(args, "use_transformers_continuous_batching", False):
        bad.append("use_transformers_continuous_batching=True")
    if args.use_liger_kernel:
        bad.append("use_liger_kernel=True (Liger's kernels would replace the aligned ones the rollout and the training "
                   "forward share)")
    other = sorted(set(args.generation_kwargs or {}) - set(GENERATION_KWARGS))
    if other:
        bad.append(f"generation_kwargs {other} (only {list(GENERATION_KWARGS)})")
    if args.temperature <= 0:
        bad.append(f"temperature={args.temperature} (the trainer samples: it must be > 0)")
    if getattr(args, "fsdp", None) or getattr(args, "deepspeed", None):
        bad.append("FSDP/DeepSpeed (the rollout engine needs the full weights in this process)")
    if (getattr(args, "loss_type", None) == "vespo" and getattr(args, "vllm_importance_sampling_correction", False)
            and args.vllm_importance_sampling_mode not in ("token_truncate", "token_mask")):  # TRL's check under vLLM
        bad.append(f"loss_type='vespo' with vllm_importance_sampling_mode={args.vllm_importance_sampling_mode!r} "
                   "(VESPO needs 'token_truncate' or 'token_mask')")
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
    coef = getattr(args, "router_aux_loss_coef", 0.0)
    coef = getattr(config, "router_aux_loss_coef", 0.0) if coef is None else coef
    return hasattr(config, "output_router_logits") and coef != 0.0


class ExactRolloutsMixin:
    """What the Vexact trainers add to a TRL trainer with a vLLM backend (``GRPOTrainer``,
    ``RLOOTrainer``, ``DistillationTrainer``): its rollouts from `vexact_models.LLM`, its training
    logprobs (where it reads them through TRL's fused LM head) equal to the rollout's bitwise.
    A subclass's ``__init__`` calls `_exact_policy` before TRL's and `_use_exact_rollouts` after it."""

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
        policy_architecture(policy, name)
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
            steps = getattr(self.args, "steps_per_generation", None) or self.args.gradient_accumulation_steps
            kw = {"max_num_seqs": self.args.per_device_train_batch_size * steps,
                  "seed": self.args.seed + self.accelerator.process_index}
            if linear_state_spec(policy) is not None:  # TRL repeats each prompt: its repeats take its state
                kw["prefix_states"] = max(1, kw["max_num_seqs"] // getattr(self.args, "num_generations", 1))
            if self.accelerator.device.type == "cuda":
                kw["gpu_memory_utilization"] = self.args.vllm_gpu_memory_utilization
            tokenizer = getattr(self.processing_class, "tokenizer", self.processing_class)  # a processor's own
            llm = LLM(policy, **{**kw, "tokenizer": tokenizer, **(llm_kwargs or {})})
        extra = {k: v for k, v in (self.args.generation_kwargs or {}).items() if k not in TEXT_ONLY_KWARGS}
        sampling = {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
                    "min_p": self.min_p or 0.0, "repetition_penalty": self.args.repetition_penalty,
                    "max_tokens": self.max_completion_length, **extra}
        # the model's EOS ids stop a completion unless ignore_eos (vLLM leaves them out of stop_token_ids then)
        sampling["stop_token_ids"] = [] if extra.get("ignore_eos") else list(self.eos_token_ids)
        sampling["top_k"] = sampling["top_k"] if sampling["top_k"] not in (None, 0) else -1  # TRL's and vLLM's "off"
        regex = getattr(self.args, "vllm_structured_outputs_regex", None)
        if regex is not None:  # TRL's own option, which wins over generation_kwargs' (as in TRL)
            sampling["structured_outputs"] = {"regex": regex}
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
            ``gpu_memory_utilization`` = ``args.vllm_gpu_memory_utilization``; for a
            gated-DeltaNet hybrid ``prefix_states`` = that batch's distinct prompts, so that the
            ``num_generations`` repeats TRL makes of a prompt compute it once).
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


class VexactDistillationTrainer(ExactRolloutsMixin, DistillationTrainer):
    """``trl.DistillationTrainer`` (on-policy distillation: the student samples its completions,
    then learns the teacher's next-token distribution on them) with the student's samples from
    `vexact_models.LLM` over its own weights: drawn from exactly the distribution it trains.
    The same extra arguments as `VexactGRPOTrainer`; the teacher is TRL's (``teacher_model``)."""

    def __init__(self, model, teacher_model=None, args: DistillationConfig | None = None, *, llm: LLM | None = None,
                 llm_kwargs: dict | None = None, exact_logprobs: bool = True, **kwargs) -> None:
        if args is None:
            args = DistillationConfig("vexact-distillation")
        model = self._exact_policy(model, args, llm, exact_logprobs)
        super().__init__(model, teacher_model, args, **kwargs)
        self._use_exact_rollouts(llm, llm_kwargs, exact_logprobs, False)
