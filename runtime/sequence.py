"""One sample of one request: its tokens, its KV pages and its progress through the runtime."""

from __future__ import annotations

import enum
import itertools

from .sampling_params import MAX_SEED, SamplingParams

__all__ = ["Sequence", "SequenceStatus"]


class SequenceStatus(enum.Enum):
    """Where a sequence is in the scheduler's life cycle."""

    WAITING = enum.auto()  # queued: not admitted yet, or preempted (its KV is gone)
    RUNNING = enum.auto()  # admitted: owns KV pages and is scheduled step by step
    FINISHED = enum.auto()  # done ("stop", "length" or "error"); owns no pages


# Process-wide, so seq_ids stay unique even across several engines in one process. Nothing
# numeric depends on seq_id (sampling is keyed by the seed), so its exact value is irrelevant
# to reproducibility.
_seq_counter = itertools.count()


class Sequence:
    """One sample (``sample_index`` of ``params.n``) of one request.

    ``token_ids`` holds the prompt followed by the generated tokens. The first
    ``num_computed_tokens`` of them have their K/V in the paged cache, at the pages listed in
    ``block_table`` (position ``p`` lives in page ``block_table[p // block_size]``). A
    preemption by recompute drops the pages and resets ``num_computed_tokens`` to 0; the
    tokens themselves are kept, so the sequence later re-prefills prompt + outputs and carries
    on exactly where it was.

    ``arrival`` is set by the scheduler when the sequence is added (-1 before): it orders the
    waiting queue (FIFO) and picks preemption victims (latest arrival first).
    """

    def __init__(
        self,
        request_id: int,
        sample_index: int,
        prompt_token_ids: list[int],
        params: SamplingParams,
        seed: int,
    ) -> None:
        if len(prompt_token_ids) == 0:
            # The first sampled token needs the logits of a last prompt position.
            raise ValueError(f"request {request_id}: prompt_token_ids must not be empty")
        if not 0 <= sample_index < params.n:
            raise ValueError(
                f"request {request_id}: sample_index={sample_index} is outside [0, {params.n})"
            )
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < MAX_SEED:
            raise ValueError(f"request {request_id}: seed={seed!r} is outside [0, 2**63)")
        self.seq_id: int = next(_seq_counter)
        self.request_id = request_id
        self.sample_index = sample_index
        self.params = params
        self.seed = seed
        # Copy: the caller's list (often shared by the n samples) must never see our appends.
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens: int = len(self.token_ids)
        self.num_computed_tokens: int = 0
        self.block_table: list[int] = []
        # leading block_table entries whose pages a sliding window has left (BlockManager.release_behind_window):
        # no longer this sequence's, never read again; and the content key the last of them had
        self.released_blocks: int = 0
        self.released_key: bytes | None = None
        # its pages in the window group of a model mixing windowed and full attention layers
        # (`runtime.page_groups.WindowTable`, made at its first pages there); None otherwise
        self.window_pages = None
        self.output_logprobs: list[float] = []
        # by output index, where params.logprobs asks for the most probable tokens too: the place
        # of the position's token ids, logprobs and rank in its step's host arrays (`runtime.top_logprobs.Stored`)
        self.top_logprobs: dict[int, tuple] = {}
        # by prompt index (1..P-1) where params.prompt_logprobs asks, on the request's first sample
        self.prompt_top_logprobs: dict[int, tuple] = {}
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.error: str | None = None
        # the request's stop strings (`runtime.stop_strings.StopStrings`, set by the engine), and
        # the one that finished it
        self.stop_strings = None
        self.stop_reason: str | int | None = None
        # where params.structured_outputs constrains it: its place in the grammar
        # (`runtime.grammar_masks.GrammarState`, set by the engine, fed by Scheduler.postprocess)
        self.grammar = None
        # the request's params.bad_words as token sequences (`runtime.bad_words.BadWords`, set by the engine)
        self.bad_words = None
        self.arrival: int = -1

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Generated tokens so far."""
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        """The generated tokens (a copy)."""
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens whose K/V are not in the cache yet (the whole sequence after a preemption)."""
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def prompt_unscored(self) -> bool:
        """Whether this sample scores its request's prompt (``params.prompt_logprobs``, the first
        sample) and some prompt position is not scored yet: it then takes no shared page."""
        return (self.params.prompt_logprobs is not None and self.sample_index == 0
                and len(self.prompt_top_logprobs) < self.num_prompt_tokens - 1)

    @property
    def samples_from_its_last_token(self) -> bool:
        """Whether its next token's mask or bans depend on its last token (a grammar, a bad word
        of several tokens), which the host must then know: a step scheduled ahead of it samples only
        after the step before is postprocessed (`runtime.llm_steps`)."""
        return self.grammar is not None or (self.bad_words is not None and self.bad_words.needs_history)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def last_token(self) -> int:
        return self.token_ids[-1]

    def append_token(self, token_id: int, logprob: float) -> None:
        """Record one sampled token and the logprob the sampler reported for it."""
        if self.status is SequenceStatus.FINISHED:
            raise RuntimeError(f"{self!r}: cannot append a token to a finished sequence")
        self.token_ids.append(token_id)
        self.output_logprobs.append(logprob)

    def __repr__(self) -> str:
        return (
            f"Sequence(seq_id={self.seq_id}, request_id={self.request_id}, "
            f"sample_index={self.sample_index}, status={self.status.name}, "
            f"tokens={self.num_prompt_tokens}+{self.num_output_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={len(self.block_table)})"
        )
