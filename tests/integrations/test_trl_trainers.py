"""TRL's trainers given a checkpoint path load the class its ``config.architectures`` names from
the ``transformers`` namespace (``trl.trainer.utils.create_model_from_path``), not through an
Auto class. After `vexact_models.patch()` that name is ours (`patches.auto`), so ``SFTTrainer``
(padded, padding-free, packed), ``DPOTrainer``, ``KTOTrainer`` and ``GRPOTrainer`` (the last three
load their reference model from the path too) train our class, with stock's losses, whichever of
TRL and vexact_models was imported first."""

import subprocess
import sys

import pytest
import torch

pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

from trl import DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer, KTOConfig, KTOTrainer, SFTConfig, SFTTrainer  # noqa: E402

import vexact_models  # noqa: E402
from vexact_models.registry import get  # noqa: E402
from vexact_models.runtime.generate_cache import GenerateCache  # noqa: E402

TEXTS = [" ".join(f"t{i}" for i in range(3, 3 + n)) for n in (5, 9, 4, 12, 7, 3)]
PAIRS = {"prompt": ["t3 t4 t5", "t7 t8", "t9 t10 t11 t12"], "chosen": [" t6 t7", " t9", " t13 t14 t15"],
         "rejected": [" t2", " t2 t2 t2", " t5"]}
UNPAIRED = {"prompt": ["t3 t4 t5", "t7 t8", "t9 t10", "t5"], "completion": [" t6", " t9 t2", " t11", " t2"],
            "label": [True, False, True, False]}
GRPO = {"num_generations": 3, "max_completion_length": 6, "beta": 0.1}  # beta: TRL loads a reference model too
#: case -> (trainer, its config, config fields, dataset)
CASES = {"sft": (SFTTrainer, SFTConfig, {}, {"text": TEXTS}),
         "sft padding_free": (SFTTrainer, SFTConfig, {"padding_free": True, "max_length": None}, {"text": TEXTS}),
         "sft packing": (SFTTrainer, SFTConfig, {"packing": True}, {"text": TEXTS}),
         "dpo": (DPOTrainer, DPOConfig, {}, PAIRS), "dpo padding_free": (DPOTrainer, DPOConfig, {"padding_free": True}, PAIRS),
         "kto": (KTOTrainer, KTOConfig, {}, UNPAIRED), "grpo": (GRPOTrainer, GRPOConfig, GRPO, {"prompt": PAIRS["prompt"]})}


def completion_length(completion_ids, **kwargs) -> list[float]:
    """GRPO reward: the number of completion tokens."""
    return [float(len(c)) for c in completion_ids]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, trl_grpo_example):
    """A tiny random Qwen3 checkpoint written by stock transformers, and its word-level tokenizer."""
    arch = get("qwen3")
    config = arch.tiny_config(vocab_size=32, tie_word_embeddings=False)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("qwen3")
    arch.hf_class()(config).save_pretrained(path)
    return path, trl_grpo_example.toy_tokenizer(config)


def train(case: str, checkpoint, out, ours: bool) -> tuple[list[type], list[float]]:
    """The classes TRL built from the path (the policy, and the reference model where it has
    one), and the losses of three steps."""
    path, tokenizer = checkpoint
    trainer_class, config_class, fields, data = CASES[case]
    args = config_class(output_dir=str(out), per_device_train_batch_size=3, max_steps=3, learning_rate=1e-2,
                        logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, bf16=False,
                        disable_tqdm=True, seed=7, **fields)
    extra = {"reward_funcs": completion_length} if trainer_class is GRPOTrainer else {}
    (vexact_models.patch if ours else vexact_models.unpatch)()
    try:
        trainer = trainer_class(model=str(path), args=args, processing_class=tokenizer,
                                train_dataset=datasets.Dataset.from_dict(data), **extra)
    finally:
        vexact_models.unpatch()
    trainer.train()
    models = [trainer.model] + [m for m in [getattr(trainer, "ref_model", None)] if m is not None]
    return [type(m) for m in models], [h["loss"] for h in trainer.state.log_history if "loss" in h]


@pytest.mark.parametrize("case", sorted(CASES))
def test_trainers_given_a_path_train_our_class_with_stock_losses(case, checkpoint, tmp_path, monkeypatch):
    """GRPO's completions come from our class's ``generate``, whose steps after each prompt's run
    its KV cache serves (`runtime.generate_cache`)."""
    arch = get("qwen3")
    served, logits = [], GenerateCache.logits
    monkeypatch.setattr(GenerateCache, "logits", lambda cache, *a: served.append(logits(cache, *a)) or served[-1])
    ours, our_losses = train(case, checkpoint, tmp_path / "ours", ours=True)
    if case == "grpo":  # 3 steps of one generate call each: a prefill, then the cached steps
        assert len(served) > 3 and all(out is not None for out in served)
    stock, stock_losses = train(case, checkpoint, tmp_path / "stock", ours=False)
    assert set(ours) == {arch.causal_lm_class} and set(stock) == {arch.hf_class()}
    assert len(ours) == (1 if case.startswith("sft") else 2)  # DPO, KTO and GRPO (beta > 0) load a reference
    assert len(our_losses) == 3 and our_losses != [our_losses[0]] * 3  # trained
    assert our_losses == pytest.approx(stock_losses, rel=1e-5)


@pytest.mark.parametrize("first", ["trl", "vexact_models"])
def test_every_transformers_module_object_trl_holds_names_our_class(first):
    """Importing TRL's trainers before or after vexact_models, every ``transformers`` object a TRL
    module holds (two on the releases we know: transformers' processing_utils replaces the first)
    gives our class after `patch()` and stock's after `unpatch()`."""
    imports = ["from trl import SFTTrainer, DPOTrainer, GRPOTrainer", "import vexact_models"]
    script = "\n".join(imports if first == "trl" else imports[::-1]) + """
import sys, types
from vexact_models.registry import get
arch = get("qwen3")
held = {id(v): v for m in list(sys.modules.values()) if m.__name__.startswith("trl")
        for v in vars(m).values() if type(v) is type(sys.modules["transformers"]) and v.__name__ == "transformers"}
vexact_models.patch()
assert all(t.Qwen3ForCausalLM is arch.causal_lm_class for t in held.values()), "patched"
vexact_models.unpatch()
assert all(t.Qwen3ForCausalLM is arch.hf_class() for t in held.values()), "unpatched"
print(len(held))
"""
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert int(run.stdout.split()[-1]) >= 1


def test_grpo_with_transformers_continuous_batching_rolls_out_on_the_engine(checkpoint, tmp_path, monkeypatch):
    """TRL's ``use_transformers_continuous_batching`` (its rollout path without vLLM) calls
    ``generate_batch``: after `patch()` each step's completions come from the rollout engine
    (`vexact_models.batch_generation`; stock's paged runtime failed every request on our forward,
    and TRL read empty completions), and the policy trains on them."""
    from vexact_models.runtime import LLM

    path, tokenizer = checkpoint
    calls, generate = [], LLM.generate
    monkeypatch.setattr(LLM, "generate", lambda self, *a, **k: calls.append(len(a[0])) or generate(self, *a, **k))
    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=3, max_steps=3, learning_rate=1e-2,
                      logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, bf16=False, disable_tqdm=True,
                      seed=7, use_transformers_continuous_batching=True, **GRPO)
    vexact_models.patch()
    try:
        trainer = GRPOTrainer(model=str(path), args=args, processing_class=tokenizer, reward_funcs=completion_length,
                              train_dataset=datasets.Dataset.from_dict({"prompt": PAIRS["prompt"]}))
    finally:
        vexact_models.unpatch()
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(calls) == 3 and all(n == 3 for n in calls)  # one engine call a step, its three prompts
    assert len(logs) == 3 and all(h["completions/mean_length"] > 0 for h in logs)
    assert [h["loss"] for h in logs] != [logs[0]["loss"]] * 3
