"""`LLM`'s requests: prompts (token ids, text through the tokenizer, vLLM's prompt dicts) and their
sampling parameters checked, grammars compiled, bad words tokenized, and all turned into sequences,
each sample with its seed, stop strings, bad words and place in its grammar; finished sequences
turned into `RequestOutput`s (text, stop string cut, cumulative logprob)."""

from __future__ import annotations

import math
import operator
from dataclasses import replace

from .bad_words import BadWords, bad_word_ids
from .grammar_masks import GrammarState, grammar_trigger
from .llm_args import prompt_of
from .logit_bias import check_token_lists
from .outputs import CompletionOutput, RequestOutput
from .sampling_params import MAX_SEED, SamplingParams
from .sequence import Sequence
from .stop_strings import StopStrings, stop_holdback, truncate_at_stop
from .structured_outputs import Grammars
from .top_logprobs import completion_logprobs, prompt_logprobs_of

__all__ = ["RequestsMixin"]

_SEED_STRIDE = 0x9E3779B97F4A7C15  # odd 64-bit constant: spreads derived seeds


def _derive_seed(base: int, index: int) -> int:
    """The seed of request (or sample) `index` under `base`."""
    return (base * 1_000_003 + (index + 1) * _SEED_STRIDE) % (1 << 63)


class RequestsMixin:
    """Prompts into sequences and sequences into outputs, for `LLM` (its ``tokenizer``, ``config``,
    ``max_model_len``, ``eos_token_ids``, ``seed``, ``max_logprobs`` and ``pipeline``)."""

    _grammars: Grammars | None = None  #: the compiler over the engine's tokenizer, made at its first use

    def _check_params(self, params: list[SamplingParams]) -> None:
        """Refuse what the engine cannot do with `params` (ValueError naming the field): on
        pipeline stages, the alternatives, penalties, logit edits, grammars and bad words; stop
        strings, grammars or bad words without a tokenizer; token lists outside the vocabulary;
        ``logprobs`` / ``prompt_logprobs`` above the engine's ``max_logprobs`` (more than the
        vocabulary return it whole)."""
        if self.pipeline is not None and any(p.logprobs is not None or p.prompt_logprobs is not None for p in params):
            raise ValueError("LLM.generate: SamplingParams.logprobs and prompt_logprobs (the most probable tokens) are "
                             "not available on pipeline stages; leave them None for each sampled token's logprob")
        if self.pipeline is not None and any(p.uses_penalties or p.edits_logits or p.structured_outputs is not None
                                             or p.bad_words for p in params):
            raise ValueError("LLM.generate: SamplingParams.repetition_penalty, frequency_penalty, presence_penalty, "
                             "allowed_token_ids, logit_bias, structured_outputs and bad_words are not available on "
                             "pipeline stages (the last stage samples without them); leave them at 1, 0, 0, None, "
                             "None, None and []")
        for field, used in (("stop (stop strings)", any(p.stop for p in params)),
                            ("structured_outputs", any(p.structured_outputs is not None for p in params)),
                            ("bad_words", any(p.bad_words for p in params))):
            if used and self.tokenizer is None:
                raise ValueError(f"LLM.generate: SamplingParams.{field} needs a tokenizer: load a checkpoint folder "
                                 "that has one, or pass LLM(..., tokenizer=...)")
        check_token_lists(params, self.config.vocab_size)
        for i, p in enumerate(params):
            for name in ("logprobs", "prompt_logprobs"):
                k = getattr(p, name)
                if k is not None and k > self.max_logprobs:
                    raise ValueError(f"LLM.generate: SamplingParams.{name}={k} (request {i}) is above the engine's "
                                     f"max_logprobs={self.max_logprobs}; build it with LLM(..., max_logprobs={k})")

    def _bad_words(self, params: list[SamplingParams]) -> list[BadWords | None]:
        """Each request's `BadWords` (None where it has none), tokenized before any request runs."""
        return [BadWords(bad_word_ids(self.tokenizer, p.bad_words, self.config.vocab_size)) if p.bad_words else None
                for p in params]

    def _compile_grammars(self, params: list[SamplingParams]) -> list:
        """Each request's compiled grammar (None where it has no ``structured_outputs``); a
        ValueError naming the field when one does not compile, before any request runs."""
        if all(p.structured_outputs is None for p in params):
            return [None] * len(params)
        if self._grammars is None or self._grammars.tokenizer is not self.tokenizer:
            self._grammars = Grammars(self.tokenizer, self.config.vocab_size, self.eos_token_ids)
        return [None if p.structured_outputs is None else self._grammars.compile(p.structured_outputs)
                for p in params]

    def _token_ids(self, prompt, params: SamplingParams | None = None) -> list[int]:
        """The checked token ids of one prompt (a ValueError naming what is wrong), the last
        ``params.truncate_prompt_tokens`` of them where it is set."""
        prompt = prompt_of(prompt)
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("LLM.generate: text prompts need a tokenizer (the checkpoint folder's, or LLM(..., "
                                 "tokenizer=...)); pass token ids")
            # tokenized text gets the same checks as token ids (empty, out of vocabulary, too long)
            prompt = self.tokenizer(prompt)["input_ids"]
        try:  # operator.index: ints (and integer tensors/numpy ints) only, never 3.7 -> 3 or True
            ids = [operator.index(t) if not isinstance(t, bool) else None for t in prompt]
        except TypeError:
            ids = [None]
        if None in ids:
            raise ValueError("LLM.generate: prompt token ids must be integers")
        vocab = self.config.vocab_size
        if not ids:
            raise ValueError("LLM.generate: prompt is empty (it needs at least one token)")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"LLM.generate: prompt token id {bad[0]} is outside the vocabulary [0, {vocab})")
        keep = None if params is None else params.truncate_prompt_tokens
        if keep is not None:
            keep = self.max_model_len - 1 if keep == -1 else keep  # -1: the longest prompt the engine takes
            if keep > self.max_model_len:
                raise ValueError(f"LLM.generate: SamplingParams.truncate_prompt_tokens={keep} is above max_model_len="
                                 f"{self.max_model_len}; select a smaller truncation size")
            ids = ids[-keep:]
        if len(ids) >= self.max_model_len:
            raise ValueError(f"LLM.generate: prompt length {len(ids)} must be below max_model_len={self.max_model_len}")
        return ids

    def _make_sequences(self, request_id: int, ids: list[int], params: SamplingParams, grammar=None,
                        bad_words: BadWords | None = None) -> list[Sequence]:
        """The ``params.n`` sequences of one request: the model's extra EOS ids as stop tokens,
        each sample's seed, the request's stop strings and `bad_words`, and a matcher of its
        compiled `grammar` (xgrammar's ``CompiledGrammar``, None: unconstrained) for each sample."""
        extra_eos = self.eos_token_ids[1:]
        if extra_eos and not params.ignore_eos:
            params = replace(params, stop_token_ids=list(params.stop_token_ids) + extra_eos)
        base = params.seed % MAX_SEED if params.seed is not None else _derive_seed(self.seed, request_id)
        seqs = [Sequence(request_id, i, ids, params, base if params.n == 1 else _derive_seed(base, i))
                for i in range(params.n)]
        if params.stop:
            stop = StopStrings(self.tokenizer, params.stop, params.decode_options)
            for seq in seqs:
                seq.stop_strings = stop
        for seq in seqs:
            seq.bad_words = bad_words
        if grammar is not None:
            trigger = grammar_trigger(self.tokenizer, params.structured_outputs.after_reasoning, ids)
            for seq in seqs:
                seq.grammar = GrammarState(self._grammars.matcher(grammar), trigger)
        return seqs

    def _output(self, prompt, ids: list[int], seqs: list[Sequence]) -> RequestOutput:
        """One request's `RequestOutput` from its sequences (finished ones, but for `LLM.step`'s
        outputs of running requests)."""
        text = prompt_of(prompt)
        return RequestOutput(seqs[0].request_id, text if isinstance(text, str) else None, ids,
                             [self._completion(seq) for seq in seqs], self._prompt_scores(seqs[0]))

    def _completion(self, seq: Sequence, start: int = 0, whole: bool = True) -> CompletionOutput:
        """One sample's `CompletionOutput`: its tokens and logprobs from output `start` on; its text
        and cumulative logprob, of the whole sample, unless not `whole` (None). As vLLM's, the text
        leaves out the stop string or stop token that finished the sample (unless
        ``include_stop_str_in_output``), and while it runs the characters a stop string may
        still be forming in (`stop_holdback`), so that no stop string's start is taken back (a
        last character still being decoded, U+FFFD, is replaced by the next token's)."""
        text, p = None, seq.params
        if whole and isinstance(seq.stop_reason, str):
            text = truncate_at_stop(self.tokenizer, seq.output_token_ids, seq.stop_reason,
                                    p.include_stop_str_in_output, p.decode_options)
        elif whole and self.tokenizer is not None and p.detokenize:
            ids = seq.output_token_ids
            if seq.finish_reason == "stop" and not p.include_stop_str_in_output:  # ended by a stop token
                ids = ids[:-1]
            text = self.tokenizer.decode(ids, **p.decode_options)
            if seq.finish_reason is None:
                text = text[:len(text) - stop_holdback(p)]
        logprobs = (seq.output_logprobs[start:] if p.logprobs is None
                    else completion_logprobs(seq, self.tokenizer if p.detokenize else None, start))
        return CompletionOutput(seq.sample_index, seq.output_token_ids[start:], logprobs, seq.finish_reason, text,
                                seq.error, seq.stop_reason, math.fsum(seq.output_logprobs) if whole else None)

    def _prompt_scores(self, first: Sequence):
        """The request's ``prompt_logprobs`` from its first sample, if it asked for them (None for a
        request that errored before it ran: its error says why)."""
        if first.params.prompt_logprobs is None or first.finish_reason == "error":
            return None
        return prompt_logprobs_of(first, self.tokenizer if first.params.detokenize else None)
