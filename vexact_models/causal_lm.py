"""What every architecture's causal LM shares around its one forward.

`CausalLMMixin` gives a training variant (a ``PreTrainedModel`` with ``self.model.forward_flat``
and ``self.lm_head``) HF's ``forward`` (padded or packed input, ``labels`` -> loss), the RL call
`token_logprobs`, and strict checkpoint loading. `InferenceModel` wraps the same modules for the
paged runtime. Both compute logits with ``linear(hidden, lm_head.weight, out_dtype=fp32)`` and
log-probabilities with `gather_logprobs`, exactly as the sampler does.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from vexact_models.kernels import linear, token_logprobs
from vexact_models.layers import (FlatBatch, PackedContext, PagedContext, RopeTables, check_tokens, flatten_inputs,
                                  head_dim_of)


class StrictLoadingMixin:
    """Mixed into our ``PreTrainedModel`` classes (before ``PreTrainedModel``)."""

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        """HF ``from_pretrained``, but a checkpoint with a missing or mis-shaped tensor is an
        error naming the tensor (HF would initialise a missing one randomly with a warning, and
        reports a mis-shaped one only in its log)."""
        want_info = kwargs.pop("output_loading_info", False)
        ignore_mismatched = kwargs.pop("ignore_mismatched_sizes", False)
        model, info = super().from_pretrained(*args, output_loading_info=True, ignore_mismatched_sizes=True, **kwargs)
        missing = sorted(info.get("missing_keys") or [])
        if missing:
            raise ValueError(f"{cls.__name__}.from_pretrained: the checkpoint is missing tensor(s) {missing}")
        mismatched = sorted(info.get("mismatched_keys") or [])
        if mismatched and not ignore_mismatched:
            detail = ", ".join(f"{name} has shape {tuple(got)} but the model expects {tuple(want)}"
                               for name, got, want in mismatched)
            raise ValueError(f"{cls.__name__}.from_pretrained: checkpoint tensor(s) with the wrong shape: {detail}")
        return (model, info) if want_info else model



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
        (over `rope_dim` dims; default the head dim)."""
        if getattr(config, "use_sliding_window", False):
            raise ValueError(f"{type(self).__name__}: use_sliding_window=True is not supported")
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList(layer_class(config, i) for i in range(config.num_hidden_layers))
        self.norm = norm_class(config.hidden_size, eps=config.rms_norm_eps)
        self.rope = RopeTables(config, rope_dim or head_dim_of(config))
        self.gradient_checkpointing = False

    def forward_flat(self, input_ids: torch.Tensor, positions: torch.Tensor, context, **layer_kwargs) -> torch.Tensor:
        """The one forward: ``[T]`` tokens at ``[T]`` positions -> ``[T, hidden]`` final hidden."""
        rope = self.rope.get(input_ids.device)
        hidden, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
                hidden, residual = torch.utils.checkpoint.checkpoint(layer, hidden, residual, positions, rope, context,
                                                                     use_reentrant=False, **layer_kwargs)
            else:
                hidden, residual = layer(hidden, residual, positions, rope, context, **layer_kwargs)
        return self.norm(hidden, residual)[0]

    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.LongTensor | None = None, cu_seqlens: torch.Tensor | None = None,
                **kwargs) -> BaseModelOutputWithPast:
        """HF-compatible forward on padded (``attention_mask``) or packed (``position_ids``
        restarting at 0, or ``cu_seqlens``) input; returns ``last_hidden_state`` in the input's
        shape (zeros at padding)."""
        if input_ids is None:
            raise ValueError(f"{type(self).__name__}.forward needs input_ids (inputs_embeds is not supported)")
        flat = flatten_inputs(input_ids, attention_mask, position_ids, cu_seqlens)
        check_tokens(flat.input_ids, flat.positions, self.config.vocab_size, self.rope.max_positions)
        hidden = self.forward_flat(flat.input_ids, flat.positions, PackedContext(flat.cu_seqlens, flat.max_seqlen))
        out = hidden.new_zeros(flat.shape.numel(), hidden.shape[-1]).index_copy(0, flat.index, hidden)
        return BaseModelOutputWithPast(last_hidden_state=out.view(*flat.shape, -1))


class CausalLMMixin(StrictLoadingMixin):
    """Mixed into each architecture's ``XForCausalLM`` (before ``PreTrainedModel``)."""

    def _forward_hidden(self, input_ids, attention_mask, position_ids, cu_seqlens,
                        **forward_kwargs) -> tuple[torch.Tensor, FlatBatch]:
        if input_ids is None:
            raise ValueError(f"{type(self).__name__}.forward needs input_ids (inputs_embeds is not supported)")
        flat = flatten_inputs(input_ids, attention_mask, position_ids, cu_seqlens)
        check_tokens(flat.input_ids, flat.positions, self.config.vocab_size, self.model.rope.max_positions)
        context = PackedContext(flat.cu_seqlens, flat.max_seqlen)
        return self.model.forward_flat(flat.input_ids, flat.positions, context, **forward_kwargs), flat

    def _padded_logits(self, hidden: torch.Tensor, flat: FlatBatch, logits_to_keep: int) -> torch.Tensor:
        """fp32 logits in the input's shape (zeros at padding)."""
        logits_flat = linear(hidden, self.lm_head.weight, out_dtype=torch.float32)
        logits = logits_flat.new_zeros(flat.shape.numel(), logits_flat.shape[-1]).index_copy(0, flat.index, logits_flat)
        logits = logits.view(*flat.shape, -1)
        return logits[..., -logits_to_keep:, :] if logits_to_keep else logits

    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.LongTensor | None = None, labels: torch.LongTensor | None = None,
                cu_seqlens: torch.Tensor | None = None, logits_to_keep: int = 0, **kwargs) -> CausalLMOutputWithPast:
        """HF-compatible forward.

        Input is padded (``attention_mask``, left or right padding; positions count from each
        row's first token) or packed (``position_ids`` restarting at 0 per sequence, or
        ``cu_seqlens``). Returns fp32 ``logits`` in the input's shape (zeros at padding) and,
        with ``labels``, HF's shifted cross-entropy ``loss``. ``past_key_values``/``use_cache``
        are ignored: rollouts use `vexact_models.LLM`.
        """
        logits, loss = self._logits_and_loss(input_ids, attention_mask, position_ids, labels, cu_seqlens,
                                             logits_to_keep, **kwargs)
        return CausalLMOutputWithPast(loss=loss, logits=logits)

    def _logits_and_loss(self, input_ids, attention_mask, position_ids, labels, cu_seqlens, logits_to_keep: int,
                         router_logits: list | None = None, **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The body of every ``forward``: padded fp32 logits and, with ``labels``, HF's loss.
        MoE models pass a list that collects each MoE layer's router logits."""
        for unused in ("use_cache", "past_key_values", "return_dict"):
            kwargs.pop(unused, None)
        layer_kwargs = {} if router_logits is None else {"router_logits": router_logits}
        hidden, flat = self._forward_hidden(input_ids, attention_mask, position_ids, cu_seqlens, **layer_kwargs)
        logits = self._padded_logits(hidden, flat, logits_to_keep)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return logits, loss

    def _router_logits_list(self, output_router_logits: bool | None) -> list | None:
        """A list to collect router logits in when asked (argument, else the config's
        ``output_router_logits``, a field only newer transformers versions have), else None."""
        if output_router_logits is None:
            output_router_logits = getattr(self.config, "output_router_logits", False)
        return [] if output_router_logits else None

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
        hidden, flat = self._forward_hidden(input_ids, attention_mask, position_ids, cu_seqlens)
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
        lp = token_logprobs(hidden[src], self.lm_head.weight, flat.input_ids[src + 1], temperature, chunk_tokens)
        out_flat = lp.new_zeros(n_tokens).index_copy(0, src + 1, lp)
        return out_flat.new_zeros(flat.shape.numel()).index_copy(0, flat.index, out_flat).view(flat.shape)

    def kv_cache_spec(self) -> tuple[int, int, int, int]:
        """(layers, KV heads, key head dim, value head dim) of this model's paged KV cache."""
        cfg = self.config
        head_dim = head_dim_of(cfg)
        return cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim, head_dim

class InferenceModel(nn.Module):
    """Inference variant: drives a training-variant model's modules with the paged runtime.

    It holds the training model itself (not a copy), so both share parameter storage: an
    optimizer step on the training model is what the next rollout uses.
    """

    def __init__(self, causal_lm: nn.Module) -> None:
        super().__init__()
        self.causal_lm = causal_lm

    @property
    def config(self):
        return self.causal_lm.config

    def kv_cache_spec(self) -> tuple[int, int, int, int]:
        return self.causal_lm.kv_cache_spec()

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, context: PagedContext,
                logits_indices: torch.Tensor) -> torch.Tensor:
        """Run new tokens through the paged cache; return fp32 logits ``[n, vocab]`` for the
        flat rows ``logits_indices`` (the last token of each sequence that samples)."""
        hidden = self.causal_lm.model.forward_flat(input_ids, positions, context)
        return linear(hidden[logits_indices], self.causal_lm.lm_head.weight, out_dtype=torch.float32)

    @classmethod
    def from_pretrained(cls, path, **kwargs) -> "InferenceModel":
        return cls(cls.training_class.from_pretrained(path, **kwargs))
