"""vLLM's ``bad_words``: words a request may not generate.

Each word becomes token sequences as vLLM tokenizes it (`bad_word_ids`): the word as written
(leading spaces stripped), and with one leading space where that gives another first token and as
many tokens (the word inside a text). A sequence may not sample the last token of such a token
sequence right after the others, matched on its generated tokens only (a one-token word: never). The
sampler bans those ``(row, token)`` pairs beside the ``min_tokens`` bans (`BadWords.banned`), so a
request samples the same tokens in any batch (rule 7) and the reported logprob stays the unedited
one training recomputes.

Matching a word of several tokens needs the sequence's last tokens on the host: while such a
sequence runs, no step is scheduled ahead of the host (`Scheduler.schedule_ahead`); words of one
token do not need that.
"""

from __future__ import annotations

from .sequence import Sequence

__all__ = ["BadWords", "bad_word_ids"]


def bad_word_ids(tokenizer, words: list[str], vocab: int) -> list[tuple[int, ...]]:
    """The token sequences `words` forbid (vLLM's rule, the module docstring); ValueError naming
    the word whose tokens fall outside the model's vocabulary ``[0, vocab)``."""
    out: list[tuple[int, ...]] = []
    for word in words:
        plain = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        for ids in (plain, spaced) if spaced[:1] != plain[:1] and len(spaced) == len(plain) else (plain,):
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"LLM.generate: SamplingParams.bad_words entry {word!r} tokenizes to id {bad[0]}, "
                                 f"outside the model's vocabulary [0, {vocab})")
            if ids:
                out.append(ids)
    return out


class BadWords:
    """One request's forbidden token sequences, shared by its samples (they hold no state: each
    step's bans come from the sample's own tokens)."""

    def __init__(self, sequences: list[tuple[int, ...]]) -> None:
        self.single = sorted({ids[0] for ids in sequences if len(ids) == 1})  #: never sampled
        #: (the tokens before, the last token): the last is banned right after the others
        self.multi = sorted({(ids[:-1], ids[-1]) for ids in sequences if len(ids) > 1})

    @property
    def needs_history(self) -> bool:
        """Whether some word has several tokens (its bans need the sequence's last tokens)."""
        return bool(self.multi)

    def banned(self, seq: Sequence, end: int | None = None) -> list[int]:
        """The tokens `seq` may not sample after its first `end` tokens (default: all, on the
        host), from the generated ones among them."""
        end = len(seq.token_ids) if end is None else end
        banned = list(self.single)
        tokens, outputs = seq.token_ids, end - seq.num_prompt_tokens
        for before, last in self.multi:
            k = len(before)
            if k <= outputs and tuple(tokens[end - k:end]) == before:
                banned.append(last)
        return banned
