"""What every architecture's causal LM shares around its one forward.

`CausalLMMixin` gives a training variant (a ``PreTrainedModel`` with ``self.model.forward_flat``
and ``self.lm_head``) HF's ``forward`` (padded or packed input, ``labels`` -> loss), the RL call
`token_logprobs`, and strict checkpoint loading. `inference_model.InferenceModel` wraps the same
modules for the paged runtime. Both compute logits with ``lm_head_logits(hidden, lm_head.weight, softcap)``
(``linear`` with an fp32 output, then the config's ``final_logit_softcapping`` where it has one)
and log-probabilities with `gather_logprobs`, exactly as the sampler does.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast, MoeCausalLMOutputWithPast
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

from vexact_models.adapters import UnsupportedAdapter, forbid_adapters
from vexact_models.checkpointing import CheckpointingMixin
from vexact_models.distributed import fsdp_forward_method
from vexact_models.flat_batch import FlatBatch, check_tokens, flatten_inputs
from vexact_models.forward_arguments import cache_field, hf_flag, take_cache_arguments, unfilled_cache
from vexact_models.generation import active_cache
from vexact_models.generation_methods import GenerationMethodsMixin
from vexact_models.hidden_states import HiddenStates, hidden_states_request
from vexact_models.kernels import lm_head_logits, token_logprobs
from vexact_models.layers import PackedContext, RopeTables, head_dim_of, layer_window
from vexact_models.multimodal import load_text_model_of
from vexact_models.loading import check_loading_info, refuse_quantized_checkpoint, refuse_sharding_inside_layers
from vexact_models.patches.compat import HFCompatMixin


class StrictLoadingMixin(CheckpointingMixin, HFCompatMixin):
    """Mixed into our ``PreTrainedModel`` classes (before ``PreTrainedModel``); every model class
    has it, so it also brings `CheckpointingMixin` (activation checkpointing keeps the attention
    outputs) and `HFCompatMixin` (any ``attn_implementation`` / ``experts_implementation`` HF
    accepts loads)."""

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        """HF ``from_pretrained``, lenient where transformers is on purpose: weights a head adds
        (a new ``score`` or ``lm_head``) are initialised and reported as transformers does; but
        a decoder tensor the checkpoint lacks, or a tensor of the wrong shape (without
        ``ignore_mismatched_sizes=True``), is a `loading.CheckpointError` naming it (a
        ``RuntimeError``, as transformers raises for a mis-shaped tensor; see `vexact_models.loading`).
        Published layouts transformers converts (per-expert hub MoE checkpoints) load without
        `patch()` too (`checkpoint_conversions`), and so does the text model of a published
        multimodal checkpoint (`multimodal.load_text_model_of`). Tensor, expert or sequence parallelism
        (``tp_plan``, ...) is a ValueError: the aligned kernels run whole weights
        (`loading.refuse_sharding_inside_layers`)."""
        from vexact_models.patches.checkpoints import check_expert_tensors, checkpoint_conversions

        source = args[0] if args else kwargs.get("pretrained_model_name_or_path")
        refuse_sharding_inside_layers(cls.__name__, kwargs)
        refuse_quantized_checkpoint(cls.__name__, source, kwargs)
        # a per-expert tensor missing or mis-shaped: transformers' own error names only the fused tensor
        check_expert_tensors(cls, args, kwargs)
        load_text_model_of(cls, source, kwargs)  # a published multimodal checkpoint: its text model
        want_info = kwargs.pop("output_loading_info", False)
        ignore_mismatched = kwargs.pop("ignore_mismatched_sizes", False)
        with checkpoint_conversions(cls):
            model, info = super().from_pretrained(*args, output_loading_info=True, ignore_mismatched_sizes=True,
                                                  **kwargs)
        check_loading_info(model, info, ignore_mismatched)
        return (model, info) if want_info else model

    def save_pretrained(self, *args, **kwargs):
        """HF ``save_pretrained``, writing the layout stock transformers writes (per-expert hub
        layout for MoE models) with or without `patch()` (`checkpoint_conversions`)."""
        from vexact_models.patches.checkpoints import checkpoint_conversions

        with checkpoint_conversions(type(self)):
            return super().save_pretrained(*args, **kwargs)



class InitHookMixin:
    """Mixed into a ``PreTrainedModel`` before it: HF's weight init, then ``module.init_random(std)``
    for the modules that define it (fused experts, routers), with the config's initializer_range."""

    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        init_random = getattr(module, "init_random", None)
        if callable(init_random):
            init_random(self.config.initializer_range)


class DecoderModelMixin(StrictLoadingMixin):
    """The decoder stack's one forward, for base models with ``embed_tokens``, ``layers``,
    ``norm`` and ``rope`` (a `RopeTables`). Layers are called as
    ``layer(hidden, residual, positions, rope, context, **layer_kwargs) -> (hidden, residual)``:
    `hidden` is the previous sublayer's output not yet added to the residual stream `residual`
    (None before the first layer), so each residual add is fused into the norm after it."""

    def init_decoder_stack(self, config, layer_class, norm_class, rope_dim: int | None = None) -> None:
        """Build HF's ``embed_tokens``, ``layers``, ``norm`` and the RoPE tables from `config`
        (over `rope_dim` dims; default the head dim). A sliding window the config gives a layer
        (`layers.layer_window`) that the layer's attention does not take is a ValueError."""
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList(layer_class(config, i) for i in range(config.num_hidden_layers))
        for i, layer in enumerate(self.layers):
            attention = getattr(layer, "self_attn", None)
            window = None if attention is None else layer_window(config, i)
            if window is not None and getattr(attention, "sliding_window", None) != window:
                raise ValueError(f"{type(self).__name__}: layer {i} attends within a sliding window of {window} "
                                 f"tokens (config.sliding_window), which {type(attention).__name__} does not take")
        self.norm = norm_class(config.hidden_size, eps=config.rms_norm_eps)
        self.rope = RopeTables(config, rope_dim or head_dim_of(config))
        self.gradient_checkpointing = False

    def forward_flat(self, input_ids: torch.Tensor, positions: torch.Tensor, context,
                     inputs_embeds: torch.Tensor | None = None, hidden_states: HiddenStates | None = None,
                     **layer_kwargs) -> torch.Tensor:
        """The one forward: ``[T]`` tokens (or their ``[T, hidden]`` embeddings) at ``[T]``
        positions -> ``[T, hidden]`` final hidden. Given `hidden_states`, it keeps HF's
        ``output_hidden_states`` there: the embeddings, each layer's output (the residual stream)
        but the last, and the final normed output, each on the path to the output."""
        forbid_adapters(self.embed_tokens, "embed_tokens", "train it fully with modules_to_save=['embed_tokens']")
        hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        rope = self.rope.get(hidden.device)
        residual = None
        if hidden_states is not None:
            hidden, = hidden_states.keep(hidden, hidden)
        last = len(self.layers) - 1
        try:
            for i, layer in enumerate(self.layers):  # each checkpoints itself when asked to (`vexact_models.checkpointing`)
                hidden, residual = layer(hidden, residual, positions, rope, context, **layer_kwargs)
                if hidden_states is not None and i < last:
                    hidden, residual = hidden_states.keep(hidden + residual, hidden, residual)
        except UnsupportedAdapter as error:  # named by its module's path, ``layers.0.self_attn.q_proj``
            raise error.at(self) from None
        out = self.norm(hidden, residual)[0]
        if hidden_states is not None:
            out, = hidden_states.keep(out, out)
        return out

    def forward_hf_inputs(self, input_ids: torch.Tensor | None, attention_mask: torch.Tensor | None = None,
                          position_ids: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None,
                          inputs_embeds: torch.Tensor | None = None, output_hidden_states: bool = False,
                          **layer_kwargs) -> tuple[torch.Tensor, FlatBatch, HiddenStates | None]:
        """HF-style padded or packed input (ids or embeddings, see `flatten_inputs`) through the
        one forward: ``(final hidden [T, hidden], the flat batch, the kept hidden states or
        None)``. Embeddings give the same numbers as the ids they embed."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError(f"{type(self).__name__}.forward: pass exactly one of input_ids and inputs_embeds")
        if inputs_embeds is not None:
            if inputs_embeds.dim() not in (2, 3) or inputs_embeds.shape[-1] != self.config.hidden_size:
                raise ValueError(f"inputs_embeds must be [batch, seq, {self.config.hidden_size}] or [tokens, "
                                 f"{self.config.hidden_size}], got shape {tuple(inputs_embeds.shape)}")
            # the batch layout comes from a stand-in of the ids' shape; the rows come from the embeddings
            stand_in = torch.zeros(inputs_embeds.shape[:-1], dtype=torch.long, device=inputs_embeds.device)
            flat = flatten_inputs(stand_in, attention_mask, position_ids, cu_seqlens)
            embeds = inputs_embeds.reshape(-1, inputs_embeds.shape[-1])[flat.index]
        else:
            flat = flatten_inputs(input_ids, attention_mask, position_ids, cu_seqlens)
            embeds = None
        self.rope.ensure(check_tokens(flat.input_ids if embeds is None else None, flat.positions,
                                     self.config.vocab_size))
        states = HiddenStates(flat) if output_hidden_states else None
        context = PackedContext(flat.cu_seqlens, flat.max_seqlen)
        hidden = self.forward_flat(flat.input_ids, flat.positions, context, inputs_embeds=embeds, hidden_states=states,
                                   **layer_kwargs)
        return hidden, flat, states

    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.LongTensor | None = None, cu_seqlens: torch.Tensor | None = None,
                inputs_embeds: torch.Tensor | None = None, output_hidden_states: bool | list[int] | None = None,
                return_dict: bool | None = None, output_attentions: bool | None = None,
                **kwargs) -> BaseModelOutputWithPast | tuple:
        """HF-compatible forward on padded (``attention_mask``) or packed (``position_ids``
        restarting at 0, or ``cu_seqlens``) input ids or ``inputs_embeds``; returns
        ``last_hidden_state`` in the input's shape (zeros at padding) and, with
        ``output_hidden_states`` (a flag, or layer indices as the installed transformers takes
        them), HF's tuple of per-layer hidden states. No KV cache is kept (rollouts use
        `vexact_models.LLM`): a cache given, or one made for ``use_cache=True``, comes back
        empty in the output (`forward_arguments.unfilled_cache`); ``output_attentions=True``
        and a ``past_key_values`` holding tokens, or left empty by an earlier forward, are
        ValueErrors."""
        cache_arguments = take_cache_arguments(kwargs, output_attentions, self)
        request = hidden_states_request(output_hidden_states, self.config)
        hidden, flat, states = self.forward_hf_inputs(input_ids, attention_mask, position_ids, cu_seqlens, inputs_embeds,
                                                      bool(request))
        cache = unfilled_cache(cache_arguments, hidden.shape[0])
        out = BaseModelOutputWithPast(last_hidden_state=flat.to_padded(hidden),
                                      hidden_states=None if states is None else states.output(request),
                                      **{cache_field(BaseModelOutputWithPast): cache})
        return out if hf_flag(return_dict, self.config, "return_dict", True) else out.to_tuple()


class CausalLMMixin(GenerationMethodsMixin, StrictLoadingMixin):
    """Mixed into each architecture's ``XForCausalLM`` (before ``PreTrainedModel``; the class
    also lists HF's ``GenerationMixin`` after it, as HF's own causal LMs do). Its ``generate``
    and ``generate_batch`` come from `generation_methods.GenerationMethodsMixin`."""

    def lm_head_weight(self) -> torch.Tensor:
        """The LM head's weight, which the logit and logprob kernels read directly (a PEFT
        ``modules_to_save`` copy when one is active; LoRA on the head is an error)."""
        forbid_adapters(self.lm_head, "lm_head",
                        "train it fully with modules_to_save=['lm_head'], or merge the adapter")
        return self.lm_head.weight

    def logit_softcap(self) -> float | None:
        """The soft cap of the LM head's logits (`final_logit_softcap`), None for none."""
        return final_logit_softcap(self.config)

    def final_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits ``[rows, vocab]`` of final hidden rows: `kernels.lm_head_logits` (the head's
        GEMM, soft-capped where the config says), what the sampler and `token_logprobs` see."""
        return lm_head_logits(hidden, self.lm_head_weight(), self.logit_softcap())

    def _padded_logits(self, hidden: torch.Tensor, flat: FlatBatch, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
        """fp32 logits in the input's shape (zeros at padding), at the positions HF's
        ``logits_to_keep`` keeps (`FlatBatch.kept`): the head runs on those tokens only, and each
        row's logits do not depend on which others run (docs/design.md rule 1)."""
        tokens, kept = flat.kept(logits_to_keep)
        return kept.to_padded(self.final_logits(hidden if tokens is None else hidden[tokens]))

    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.LongTensor | None = None, labels: torch.LongTensor | None = None,
                cu_seqlens: torch.Tensor | None = None, logits_to_keep: int | torch.Tensor = 0,
                inputs_embeds: torch.Tensor | None = None, **kwargs) -> CausalLMOutputWithPast | tuple:
        """HF-compatible forward.

        Input is padded (``attention_mask``, left or right padding; positions count from each
        row's first token) or packed (``position_ids`` restarting at 0 per sequence, or
        ``cu_seqlens``), as token ids or ``inputs_embeds``. Returns fp32 ``logits`` in the
        input's shape (zeros at padding), with ``labels`` HF's shifted cross-entropy ``loss``,
        with ``output_hidden_states`` HF's per-layer hidden states (all, or those layer indices
        select); a tuple when ``return_dict=False``. No KV cache is kept (rollouts use
        `vexact_models.LLM`): a cache given, or one made for ``use_cache=True``, comes back empty
        in the output (`forward_arguments.unfilled_cache`). ``output_attentions=True``
        (the aligned attention never materialises weights) and a ``past_key_values`` holding
        tokens (a prefix this forward would not read), or left empty by an earlier forward, are
        ValueErrors (`forward_arguments`).
        """
        out = self._causal_lm_output(CausalLMOutputWithPast, input_ids, attention_mask, position_ids, labels,
                                     cu_seqlens, logits_to_keep, inputs_embeds=inputs_embeds, **kwargs)
        return self._as_requested(out, kwargs.get("return_dict"))

    def _as_requested(self, out, return_dict: bool | None):
        return out if hf_flag(return_dict, self.config, "return_dict", True) else out.to_tuple()

    def _causal_lm_output(self, output_class, input_ids, attention_mask, position_ids, labels, cu_seqlens,
                          logits_to_keep: int | torch.Tensor, router_logits: list | None = None, inputs_embeds=None,
                          output_hidden_states: bool | list[int] | None = None, output_attentions: bool | None = None,
                          **kwargs):
        """The body of every ``forward``: `output_class` with padded fp32 logits, with ``labels``
        HF's loss, and the hidden states when asked. MoE models pass a list that collects each
        MoE layer's router logits."""
        cache_arguments = take_cache_arguments(kwargs, output_attentions, self)
        for unused in ("return_dict", "cache_position"):
            kwargs.pop(unused, None)
        layer_kwargs = {} if router_logits is None else {"router_logits": router_logits}
        request = hidden_states_request(output_hidden_states, self.config)
        cache = active_cache(self)
        if cache is not None:
            servable = labels is None and not request and router_logits is None and cu_seqlens is None \
                and type(logits_to_keep) is int and logits_to_keep == 1
            logits = cache.logits(input_ids, inputs_embeds, attention_mask, position_ids) if servable \
                else cache.forget()
            if logits is not None:
                return output_class(logits=logits, **{cache_field(output_class): unfilled_cache(cache_arguments, 0)})
        hidden, flat, states = self.model.forward_hf_inputs(input_ids, attention_mask, position_ids, cu_seqlens,
                                                            inputs_embeds, bool(request), **layer_kwargs)
        logits = self._padded_logits(hidden, flat, logits_to_keep)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return output_class(loss=loss, logits=logits, hidden_states=None if states is None else states.output(request),
                            **{cache_field(output_class): unfilled_cache(cache_arguments, hidden.shape[0])})

    def _moe_forward(self, input_ids=None, attention_mask=None, position_ids=None, labels=None, cu_seqlens=None,
                     logits_to_keep: int | torch.Tensor = 0, output_router_logits: bool | None = None, **kwargs):
        """The MoE models' ``forward``: `forward`'s output as HF's ``MoeCausalLMOutputWithPast``;
        with ``output_router_logits`` each MoE layer's router logits over the non-padding tokens
        and HF's load-balancing ``aux_loss`` (added to ``loss`` times ``router_aux_loss_coef``
        when ``labels`` are given). Router logits exist for the real tokens only, so HF's loss
        needs no attention mask."""
        router = self._router_logits_list(output_router_logits)
        out = self._causal_lm_output(MoeCausalLMOutputWithPast, input_ids, attention_mask, position_ids, labels,
                                     cu_seqlens, logits_to_keep, router_logits=router, **kwargs)
        if router is not None:
            out.router_logits = tuple(router)
            out.aux_loss = load_balancing_loss_func(out.router_logits, num_routed_experts(self.config),
                                                    self.config.num_experts_per_tok, None)
            if out.loss is not None:
                out.loss = out.loss + self.config.router_aux_loss_coef * out.aux_loss.to(out.loss.device)
        return self._as_requested(out, kwargs.get("return_dict"))

    def _router_logits_list(self, output_router_logits: bool | None) -> list | None:
        """A list to collect router logits in when asked (argument, else the config's
        ``output_router_logits``, a field only newer transformers versions have), else None."""
        if output_router_logits is None:
            output_router_logits = getattr(self.config, "output_router_logits", False)
        return [] if output_router_logits else None

    @fsdp_forward_method  # on an FSDP2 root, runs the root's all-gather hooks (plain fully_shard recipe)
    def token_logprobs(self, input_ids: torch.LongTensor, attention_mask: torch.Tensor | None = None,
                       position_ids: torch.LongTensor | None = None, cu_seqlens: torch.Tensor | None = None,
                       temperature: float | torch.Tensor = 1.0, chunk_tokens: int | None = None) -> torch.Tensor:
        """Log-probability of every token given its prefix, aligned with ``input_ids``.

        Entry ``t`` is ``log softmax(logits_{t-1} / T)[input_ids[t]]`` within its sequence, fp32,
        bitwise equal to the logprob `vexact_models.LLM` reported when it sampled that token at
        temperature T (use T = 1.0 for greedy rollouts). A sequence's first token and padding
        get 0. ``temperature`` is a float or a ``[num_sequences]`` tensor. Differentiable;
        never holds ``[tokens, vocab]`` fp32 logits (chunks of ``chunk_tokens``).
        """
        hidden, flat, _ = self.model.forward_hf_inputs(input_ids, attention_mask, position_ids, cu_seqlens)
        n_tokens = hidden.shape[0]
        cu = flat.cu_seqlens.long()
        has_next = torch.ones(n_tokens, dtype=torch.bool, device=hidden.device)
        has_next[cu[1:] - 1] = False
        src = has_next.nonzero().squeeze(1)
        if isinstance(temperature, torch.Tensor):
            n_seqs = cu.shape[0] - 1
            if temperature.shape != (n_seqs,):
                raise ValueError(f"token_logprobs: temperature tensor must have shape ({n_seqs},) (one per "
                                 f"sequence), got {tuple(temperature.shape)}")
            seq_of = torch.repeat_interleave(torch.arange(n_seqs, device=hidden.device), cu[1:] - cu[:-1])
            temperature = temperature.to(hidden.device, torch.float32)[seq_of[src]]
        lp = token_logprobs(hidden[src], self.lm_head_weight(), flat.input_ids[src + 1], temperature, chunk_tokens,
                            softcap=self.logit_softcap())
        return flat.to_padded(lp.new_zeros(n_tokens).index_copy(0, src + 1, lp))

    def kv_cache_spec(self) -> tuple[int, int, int, int]:
        """(layers, KV heads, key head dim, value head dim) of this model's paged KV cache."""
        cfg = self.config
        head_dim = head_dim_of(cfg)
        return cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim, head_dim


def final_logit_softcap(config) -> float | None:
    """A config's ``final_logit_softcapping`` (Gemma's cap of the LM head's logits, ``cap *
    tanh(logits / cap)``) as a float, None when it has none; a ValueError naming the field and
    its value unless it is a finite number > 0."""
    cap = getattr(config, "final_logit_softcapping", None)
    if cap is None:
        return None
    if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not math.isfinite(cap) or cap <= 0:
        raise ValueError(f"{type(config).__name__}: final_logit_softcapping={cap!r} must be a finite number > 0 "
                         "(or None: no cap)")
    return float(cap)


def num_routed_experts(config) -> int:
    """A MoE config's routed expert count: ``num_experts`` (Qwen3-MoE), ``num_local_experts``
    (GPT-OSS, Mixtral) or ``n_routed_experts`` (DeepSeek)."""
    for field in ("num_experts", "num_local_experts", "n_routed_experts"):
        value = getattr(config, field, None)
        if value is not None:
            return int(value)
    raise ValueError(f"{type(config).__name__} has none of num_experts, num_local_experts, n_routed_experts")
