"""The rollout engine's weights and memory: `LLM.update_weights`, `LLM.sleep`, `LLM.wake_up`,
`LLM.reset_prefix_cache`.

A mixin of `runtime.llm.LLM` (it uses the engine's ``model``, ``runner``, ``scheduler``,
``device`` and ``backend``), kept apart so that each file holds one concept: serving requests
there, owning and releasing device memory here.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence as Seq

import torch

from vexact_models.adapter_weights import AdapterNames
from vexact_models.kernels import use_backend

from .engine_lock import one_call_at_a_time
from .model_runner import ModelRunner
from .sampler import Sampler
from .scheduler import Scheduler
from .weights import ReleasedWeights, copy_weights, named_targets


class EngineMemoryMixin:
    """Weight updates and vLLM-style sleep levels for `LLM`: public methods of the engine
    itself, over its own model, runner and scheduler. Besides the attributes below (set by
    ``LLM.__init__``) it uses the engine's ``backend`` and ``_remember_graphs``."""

    model: torch.nn.Module  #: the inference model (its ``causal_lm`` holds the parameters)
    runner: ModelRunner
    scheduler: Scheduler
    sampler: Sampler  #: its penalty counts are freed with the cache
    device: torch.device
    owns_weights: bool  #: whether sleep may take the weights off the device

    def _init_weight_state(self, owns_weights: bool) -> None:
        if not isinstance(owns_weights, bool):
            raise ValueError(f"LLM: owns_weights={owns_weights!r} must be a bool or None")
        self.owns_weights = owns_weights
        self._cache_epoch = 0  # counts the calls that write weights or the KV cache (LLM._keep_prefix_cache)
        self._prefix_key: tuple | None = None  # what the last generate's shared pages were computed under
        self._released: ReleasedWeights | None = None  # the weights while sleep() holds them
        self._unwritten: dict[int, torch.nn.Parameter] = {}  # uninitialised after a level-2 wake_up

    def _check_awake(self, caller: str) -> None:
        if self._released is not None or not self.runner.kv_caches:
            raise RuntimeError(f"{caller}: the engine is asleep (sleep() released the KV cache"
                               f"{' and the weights' if self._released is not None else ''}); call wake_up() first")
        if self._unwritten:
            names = [n for n, p in self.model.causal_lm.named_parameters() if id(p) in self._unwritten]
            raise RuntimeError(f"{caller}: after sleep(level=2) the weights are uninitialised until update_weights "
                               f"writes them; {len(names)} not written yet, e.g. {names[:3]}")

    @one_call_at_a_time
    @torch.no_grad()
    def update_weights(self, weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy named tensors (HF checkpoint names) into the engine's parameters, in place.

        `weights` is a dict (any mapping, e.g. a ``state_dict()``) or an iterable of ``(name,
        tensor)`` pairs, e.g. `vexact_models.distributed.stream_full_weights` (consumed lazily,
        never materialised). Tied weights answer to each of their names. Tensors may live on any
        device and have any floating dtype (cast on copy); a DTensor is gathered whole with
        ``full_tensor()`` (a collective: every rank must pass the same names in the same order).

        A mapping is checked whole first: an unknown name, a wrong shape or a non-tensor raises
        ValueError before anything is written. An iterator is checked pair by pair right before
        each copy: a bad pair raises ValueError having written every pair before it and none
        after it, so the engine then holds new and old weights mixed; send the full set again
        (the check is cheap next to the copy, and a stream cannot be rewound to check first).
        While the weights are released by `sleep` it raises RuntimeError; after
        ``sleep(level=2)`` + `wake_up` it must write every parameter before `generate` runs.
        With pipeline parallelism every stage is passed the whole set (every rank consumes the
        whole stream, in step: e.g. `stream_full_weights` of an FSDP2 trainer on the same
        ranks) and copies the tensors of its own layers, checking the others' names and shapes.
        Returns the number of tensors copied (on this stage).

        PEFT adapters (an engine over a LoRA model, the RL loop where only the adapters train):
        `weights` may hold adapter tensors only, the base staying as it is, under PEFT's names
        (``PeftModel.state_dict()``, ``get_peft_model_state_dict``, or the stream of an FSDP2
        LoRA model: ``stream_full_weights(model, adapters_only=True)``;
        `vexact_models.adapter_weights`). Every adapter tensor is checked (known name, shape,
        dtype exactly: an adapter is never cast, so that the next rollout computes with the
        trainer's values) and the adapters are written in place only after the whole input is
        consumed and checked: a bad name, shape or dtype raises ValueError with no adapter
        written, from an iterator too. Base tensors named behind ``PeftModel``'s
        ``base_model.model.`` prefix are accepted as well.
        """
        self._check_no_online("LLM.update_weights")
        if self._released is not None:
            raise RuntimeError("LLM.update_weights: the weights are released by sleep(); call wake_up() (or "
                               "wake_up(tags=['weights'])) first")
        causal_lm = self.model.causal_lm
        self._cache_epoch += 1  # (even a failed update may have written some): no page computed before is shared
        return copy_weights(named_targets(causal_lm), weights, written=lambda p: self._unwritten.pop(id(p), None),
                            adapters=AdapterNames(causal_lm))

    @one_call_at_a_time
    def sleep(self, level: int = 1) -> None:
        """Release device memory while the trainer runs, in the style of vLLM's sleep levels.

        Every level frees the KV cache and the CUDA graphs (with their memory pools). When the
        engine owns its weights (`owns_weights`: loaded from a folder, or said so), level 1
        also moves them to host memory and `wake_up` brings them back; level 2 discards them,
        and after `wake_up` they must be written by `update_weights` (e.g. the trainer's
        `stream_full_weights`) before the next `generate`. Level 0 frees only the KV cache and
        graphs. Weights shared with a trainer are never touched. Sleeping again goes only
        deeper (level 2 after level 1 drops the host copy; anything else already done is a
        no-op). Until `wake_up`, `generate` raises RuntimeError (queuing nothing).
        """
        self._check_no_online("LLM.sleep")
        if isinstance(level, bool) or level not in (0, 1, 2):
            raise ValueError(f"LLM.sleep: level={level!r} must be 0, 1 or 2")
        if self.scheduler.has_unfinished():
            raise RuntimeError("LLM.sleep: requests are still running")
        self._cache_epoch += 1
        self.runner.free_cache()
        self.sampler.release()
        if not self.owns_weights or level == 0:
            return
        if self._released is None:
            held = (p for p in self.model.causal_lm.parameters() if not p.is_meta)  # not other stages' layers
            self._released = ReleasedWeights(held, keep_copy=level == 1)
            self._unwritten = {}
        elif level == 2:
            self._released.drop_copy()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    @one_call_at_a_time
    def wake_up(self, tags: Seq[str] | None = None) -> None:
        """Undo `sleep`: ``tags`` picks what to restore, ``"weights"`` and/or ``"kv_cache"``
        (default both, weights first). Waking the weights alone first lets ``update_weights``
        fill them before the KV cache takes its memory (as in vLLM); the KV cache (and the CUDA
        graphs, which read the weights' addresses) needs the weights awake. Restoring what is
        not asleep is a no-op."""
        self._check_no_online("LLM.wake_up")
        tags = ("weights", "kv_cache") if tags is None else tuple(tags)
        unknown = sorted(set(tags) - {"weights", "kv_cache"})
        if unknown:
            raise ValueError(f"LLM.wake_up: unknown tags {unknown}; use 'weights' and/or 'kv_cache'")
        if "kv_cache" in tags and "weights" not in tags and self._released is not None:
            raise RuntimeError("LLM.wake_up: the weights are asleep; wake them first (tags=['weights']), the "
                               "KV cache's CUDA graphs read their addresses")
        self._cache_epoch += 1
        if "weights" in tags and self._released is not None:
            self._unwritten = {id(p): p for p in self._released.restore()}
            self._released = None
        if "kv_cache" in tags and not self.runner.kv_caches:
            backend = self.backend
            with use_backend(backend):  # the CUDA graphs capture the engine's kernels
                self.runner.allocate_cache()
            self._remember_graphs(backend)  # so that the next generate does not capture them again

    @one_call_at_a_time
    def reset_prefix_cache(self) -> bool:
        """Forget every page earlier calls published, as vLLM's ``LLM.reset_prefix_cache``: the
        next `generate` prefills every prompt afresh. For weights changed in a way the engine
        cannot see (written in place into an engine that owns them); `update_weights`, `sleep`
        and `wake_up` already do this. Returns True, as vLLM's does on success."""
        self._check_no_online("LLM.reset_prefix_cache")
        self._cache_epoch += 1
        self.scheduler.reset_prefix_cache()
        return True
