"""The paged-KV decoding runtime: LLM -> Scheduler -> BlockManager -> ModelRunner -> Sampler."""

from .block_manager import BlockManager
from .engine_config import EngineConfig
from .llm import LLM
from .model_runner import ModelRunner
from .outputs import CompletionOutput, RequestOutput
from .sampler import Sampler
from .sampling_params import RequestOutputKind, SamplingParams
from .scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from .sequence import Sequence, SequenceStatus
from .structured_outputs import StructuredOutputsParams

__all__ = ["BlockManager", "CompletionOutput", "EngineConfig", "LLM", "ModelRunner", "RequestOutput", "RequestOutputKind",
           "Sampler", "SamplingParams", "ScheduledSeq", "Scheduler", "SchedulerOutput", "Sequence", "SequenceStatus",
           "StructuredOutputsParams"]
