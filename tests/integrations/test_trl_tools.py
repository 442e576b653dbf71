"""TRL's agentic GRPO (``tools=`` and ``environment_factory=``) through `VexactGRPOTrainer`.

TRL runs its tool loop on the generation backend: a completion that calls a tool is extended by
the tool's result (tokens the loss masks out) and generated again from prompt + completion +
result, and the sampler's logprobs of every model token, before and after the tool, are
compared with the training forward's. Those stay bitwise equal (TRL's metrics read 0 / 1): the
engine's rollout of the extended prompt is the training forward's computation at every
position. The chat template is TRL's own Qwen3 template with its response parser; the toy
vocabulary holds one whole tool call as a single token, so that a near-uniform random model
calls the tool in a few samples of every batch.
"""

from pathlib import Path

import pytest
import torch

trl = pytest.importorskip("trl")
pytest.importorskip("datasets")

from datasets import Dataset  # noqa: E402
from trl import GRPOConfig  # noqa: E402

from vexact_models.integrations.trl import VexactGRPOTrainer  # noqa: E402
from vexact_models.registry import architectures, get  # noqa: E402

DIFF_MAX = "sampling/sampling_logp_difference/max"
IS_MIN, IS_MAX = "sampling/importance_sampling_ratio/min", "sampling/importance_sampling_ratio/max"
CALL = '<tool_call>\n{"name": "multiply", "arguments": {"a": 3, "b": 4}}\n</tool_call>'
WORDS = ["<unk>", "<|im_start|>", "<|im_end|>", "<|endoftext|>", "user", "assistant", "system", "tool",
         *(f"t{i}" for i in range(10)), "12"]


def _tool_tokenizer():
    """A word-level tokenizer under TRL's Qwen3 chat template and response parser; `CALL` is one token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import AddedToken, PreTrainedTokenizerFast
    from trl.chat_template_utils import add_response_schema

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                        unk_token="<unk>")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.add_tokens([AddedToken(CALL, normalized=False), "<tool_response>", "</tool_response>", "<think>",
                          "</think>"])
    tokenizer.chat_template = (Path(trl.__file__).parent / "chat_templates" / "qwen3.jinja").read_text()
    try:
        add_response_schema(tokenizer)
    except (ValueError, ImportError) as err:  # an older transformers without the parser TRL sets
        pytest.skip(f"TRL's tool parsing is not available here: {err}")
    return tokenizer


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a * b


class Calculator:
    """A TRL environment: its public method is the tool, it keeps the calls it served, and it
    owns a reward (``get_reward``)."""

    def reset(self, **kwargs) -> None:
        self.calls = 0

    def multiply(self, a: int, b: int) -> int:
        """Multiply two integers.

        Args:
            a: The first integer.
            b: The second integer.
        """
        self.calls += 1
        return a * b

    def get_reward(self) -> float:
        return float(self.calls)


def _completion_length(completion_ids, **kwargs) -> list[float]:
    return [float(len(ids)) for ids in completion_ids]


def _trainer(arch_name: str, tmp_path, **tool_kwargs) -> VexactGRPOTrainer:
    if arch_name not in {arch.name for arch in architectures()}:
        pytest.skip(f"{arch_name} is not registered on this transformers")
    tokenizer = _tool_tokenizer()
    eos, pad = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    config = get(arch_name).tiny_config(vocab_size=len(tokenizer), eos_token_id=eos, pad_token_id=pad,
                                        bos_token_id=None)
    torch.manual_seed(0)
    model = get(arch_name).causal_lm_class(config)
    with torch.no_grad():  # near-uniform next-token distributions: some samples call the tool
        model.lm_head.weight.mul_(0.05)
    model.save_pretrained(tmp_path / "ckpt")
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"t{i % 10} t{i * 3 % 10}"}]
                                            for i in range(16)]})
    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4,
                      max_completion_length=32, max_steps=2, logging_steps=1, save_strategy="no", learning_rate=1e-2,
                      report_to=[], use_cpu=True, bf16=False, disable_tqdm=True)
    return VexactGRPOTrainer(str(tmp_path / "ckpt"), args=args, processing_class=tokenizer, train_dataset=dataset,
                             llm_kwargs={"kv_cache_bytes": 16 << 20}, **tool_kwargs)


def _train_capturing_batches(trainer: VexactGRPOTrainer) -> list[dict]:
    """Train, keeping each generation batch TRL scored (its tool mask and completions)."""
    batches = []
    score = trainer._generate_and_score_completions

    def capture(inputs):
        batches.append(score(inputs))
        return batches[-1]

    trainer._generate_and_score_completions = capture
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    trainer.train()
    assert any(not torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())  # it did train
    return batches


def _assert_exact_with_tool_turns(trainer: VexactGRPOTrainer, batches: list[dict]) -> None:
    logs = [h for h in trainer.state.log_history if DIFF_MAX in h]
    assert len(logs) == 2 and all(h[DIFF_MAX] == 0.0 and h[IS_MIN] == h[IS_MAX] == 1.0 for h in logs), logs
    assert all(h["tools/call_frequency"] > 0 and h["tools/failure_frequency"] == 0 for h in logs), logs
    for batch in batches:
        tool_mask, completion_mask = batch["tool_mask"], batch["completion_mask"]
        result_tokens = (tool_mask == 0) & (completion_mask == 1)
        assert result_tokens.any()  # tool results were appended, and the loss masks them
        after = [row[m.nonzero().max() + 1:] for row, m in zip(tool_mask * completion_mask, result_tokens) if m.any()]
        assert any(rest.any() for rest in after)  # and the model generated again after them


@pytest.mark.parametrize("arch_name", ["qwen3", "qwen3_5"])
def test_tool_calling_grpo_stays_exactly_on_policy(arch_name, tmp_path):
    """``tools=[multiply]``: samples call the tool, its result is appended and masked, generation
    resumes after it, and TRL's sampling/training logprob difference is 0 (the IS ratio 1) at
    every step; Qwen3.5's gated-DeltaNet states are rebuilt from the extended prompt."""
    trainer = _trainer(arch_name, tmp_path, reward_funcs=_completion_length, tools=[multiply])
    _assert_exact_with_tool_turns(trainer, _train_capturing_batches(trainer))


def test_environment_grpo_stays_exactly_on_policy(tmp_path):
    """``environment_factory=Calculator``: the environment's method is the tool and its
    ``get_reward`` a reward source; the same exactness with the environment's tool turns."""
    trainer = _trainer("qwen3", tmp_path, reward_funcs=_completion_length, environment_factory=Calculator)
    batches = _train_capturing_batches(trainer)
    _assert_exact_with_tool_turns(trainer, batches)
    assert any(h.get("rewards/Calculator/mean", 0) > 0 for h in trainer.state.log_history)


def test_tool_calling_distillation_samples_the_student_exactly(tmp_path):
    """`VexactDistillationTrainer` with ``tools=[multiply]`` (TRL's on-policy distillation runs the
    same tool loop): every engine call, the first and those resuming after a tool result, returns
    the student's own ``token_logprobs`` of its completion bitwise, at the weights it then has;
    some samples call the tool, and the student trains."""
    from trl import DistillationConfig

    from vexact_models.integrations.trl import VexactDistillationTrainer

    tokenizer = _tool_tokenizer()
    eos, pad = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    config = get("qwen3").tiny_config(vocab_size=len(tokenizer), eos_token_id=eos, pad_token_id=pad, bos_token_id=None)
    for seed, name in ((0, "student"), (1, "teacher")):
        torch.manual_seed(seed)
        model = get("qwen3").causal_lm_class(config)
        with torch.no_grad():  # near-uniform next-token distributions: some samples call the tool
            model.lm_head.weight.mul_(0.05)
        model.save_pretrained(tmp_path / name)
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"t{i % 10} t{i * 3 % 10}"}]
                                            for i in range(16)]})
    args = DistillationConfig(output_dir=str(tmp_path), per_device_train_batch_size=8, max_completion_length=32,
                              max_steps=1, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, bf16=False,
                              disable_tqdm=True, learning_rate=1e-2)
    trainer = VexactDistillationTrainer(str(tmp_path / "student"), str(tmp_path / "teacher"), args=args,
                                        processing_class=tokenizer, train_dataset=dataset, tools=[multiply],
                                        llm_kwargs={"kv_cache_bytes": 16 << 20})
    student, gen = trainer.model, trainer.vllm_generation
    generate, calls = gen.generate, []

    def checked(prompts, *a, **kw):
        prompt_ids, completion_ids, logprobs, extra = generate(prompts, *a, **kw)
        for p, c, lps in zip(prompt_ids, completion_ids, logprobs):
            with torch.no_grad():
                ref = student.token_logprobs(torch.tensor([p + c]), temperature=args.temperature)[0, len(p):]
            assert torch.equal(ref, torch.tensor([lp[0] for lp in lps]))
        calls.append([tokenizer.decode(p) for p in prompt_ids])
        return prompt_ids, completion_ids, logprobs, extra

    gen.generate = checked
    before = {k: v.clone() for k, v in student.state_dict().items()}
    trainer.train()
    assert trainer.state.global_step == 1 and any(not torch.equal(before[k], v) for k, v in student.state_dict().items())
    resumed = [p for prompts in calls for p in prompts if "<tool_response>" in p]
    assert resumed  # some engine calls resumed after a tool's result
