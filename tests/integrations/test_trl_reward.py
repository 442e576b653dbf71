"""TRL's reward-model path: ``RewardTrainer(model=<a causal LM checkpoint>)`` loads it with
``AutoModelForSequenceClassification.from_pretrained(path, num_labels=1)``, which after
`vexact_models.patch()` is our head over our base model, a new ``score`` initialised from TRL's
seed exactly as stock transformers initialises it; and the trainer trains it."""


import pytest
import torch

pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

from trl import RewardConfig, RewardTrainer  # noqa: E402

import vexact_models  # noqa: E402
from vexact_models.registry import get  # noqa: E402


@pytest.fixture(scope="module")
def toy_tokenizer(trl_grpo_example):
    """examples/trl_grpo.py's word-level tokenizer (token i <-> "t<i>")."""
    return trl_grpo_example.toy_tokenizer


def trainer(path, tokenizer, out, ours: bool) -> RewardTrainer:
    pairs = {"chosen_ids": [[3, 4, 5, 6], [7, 8, 9], [10, 11, 12, 13, 14], [2, 3]],
             "rejected_ids": [[3, 4, 9], [7, 8, 2, 2], [10, 5], [2, 15, 15]]}
    args = RewardConfig(output_dir=str(out), per_device_train_batch_size=4, max_steps=3, learning_rate=5e-2,
                        logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, bf16=False,
                        disable_tqdm=True, seed=7)
    (vexact_models.patch if ours else vexact_models.unpatch)()
    try:
        return RewardTrainer(model=str(path), args=args, processing_class=tokenizer,
                             train_dataset=datasets.Dataset.from_dict(pairs))
    finally:
        vexact_models.unpatch()


def test_reward_trainer_loads_the_causal_lm_checkpoint_as_stock_and_trains(toy_tokenizer, tmp_path):
    arch = get("qwen3")
    config = arch.tiny_config(vocab_size=16, tie_word_embeddings=False)
    torch.manual_seed(0)
    arch.causal_lm_class(config).save_pretrained(tmp_path / "ckpt")
    tokenizer = toy_tokenizer(config)
    ours = trainer(tmp_path / "ckpt", tokenizer, tmp_path / "ours", ours=True)
    stock = trainer(tmp_path / "ckpt", tokenizer, tmp_path / "stock", ours=False)
    assert type(ours.model) is arch.sequence_classification_class and ours.model.config.num_labels == 1
    assert type(ours.model.model) is arch.base_model_class
    want, got = stock.model.state_dict(), ours.model.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)  # the new score too
    score = ours.model.score.weight.detach().clone()
    ours.train()
    history = [h for h in ours.state.log_history if "loss" in h]
    assert len(history) == 3 and all(torch.isfinite(torch.tensor(h["loss"])) for h in history)
    assert not torch.equal(ours.model.score.weight, score)  # trained
