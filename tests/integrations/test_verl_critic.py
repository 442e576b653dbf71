"""verl integration, the critic side, against verl's own classes: verl's critic engine
(``FSDPEngineWithValueHead``, which verl's PPO trainer builds for ``model_type="value_model"``)
loads the value head from the policy's causal-LM checkpoint through verl's ``load_valuehead_model``
(``AutoModelForTokenClassification.from_pretrained(path, num_labels=1)``, its config set as verl
sets it) as our token-classification class; the engine's values, with padding removed or not,
are our model's; and the engine trains it with verl's value loss.

Runs where verl imports (``.ci/verl`` builds that venv); skipped elsewhere. Like
`test_verl_actor.py`, verl's engine runs on a CPU platform, unsharded (FSDP wrapping needs a GPU;
tests/distributed/test_fsdp_critic.py shards a critic with FSDP2 on CPU)."""

import sys
from functools import partial
from pathlib import Path

import pytest
import torch

vv = pytest.importorskip("vexact_models.integrations.verl", reason="verl (and ray) not importable here",
                         exc_type=ImportError)

sys.path.insert(0, str(Path(__file__).parent))
from verl import DataProto  # noqa: E402
from verl.trainer.config import CheckpointConfig  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.utils.model import compute_position_id_with_mask  # noqa: E402
from verl.workers.config import CriticConfig, FSDPEngineConfig, FSDPOptimizerConfig  # noqa: E402
from verl.workers.utils.losses import value_loss  # noqa: E402
from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding  # noqa: E402
from verl_support import model_config, save_tiny  # noqa: E402
from verl_support import verl_cpu  # noqa: E402, F401  (a fixture)

from vexact_models.registry import get  # noqa: E402

P, R = 6, 5
PROMPTS = [[3, 4, 5], [7, 8, 9, 10, 11], [12], [20, 21, 22, 23]]
RESPONSES = [[30, 31], [32, 33, 34, 35, 36], [37, 38, 39], [40]]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_tiny(tmp_path_factory, "qwen3", tie_word_embeddings=False)


def critic_engine(path: str, remove_padding: bool):
    """verl's critic engine with its module built by verl's own loader, left unsharded on CPU."""
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithValueHead

    mc = model_config(path, model_type="value_model", use_remove_padding=remove_padding,
                      enable_gradient_checkpointing=True, override_config={"attn_implementation": "sdpa"})
    engine = FSDPEngineWithValueHead(mc, FSDPEngineConfig(forward_only=False, use_torch_compile=False,
                                                          model_dtype="fp32"),
                                     FSDPOptimizerConfig(lr=1e-2, clip_grad=1.0), CheckpointConfig())
    torch.manual_seed(0)
    engine.module = engine._build_module()
    engine._autocast_dtype = torch.float32  # FSDP's mixed precision is not set up without sharding
    engine.optimizer = torch.optim.SGD(engine.module.parameters(), lr=1e-2)
    return engine


def batch(remove_padding: bool):
    """verl's PPO batch layout: left-padded prompts, right-padded responses, old values and returns."""
    b = len(PROMPTS)
    ids, mask = torch.zeros(b, P + R, dtype=torch.long), torch.zeros(b, P + R, dtype=torch.long)
    for i, (p, r) in enumerate(zip(PROMPTS, RESPONSES)):
        ids[i, P - len(p):P + len(r)] = torch.tensor(p + r)
        mask[i, P - len(p):P + len(r)] = 1
    torch.manual_seed(3)
    tensors = {"prompts": ids[:, :P], "responses": ids[:, P:], "input_ids": ids, "attention_mask": mask,
               "position_ids": compute_position_id_with_mask(mask), "response_mask": mask[:, P:],
               "values": torch.zeros(b, R), "returns": torch.randn(b, R)}
    td = left_right_2_no_padding(DataProto.from_dict(tensors=tensors).to_tensordict())
    tu.assign_non_tensor(td, use_remove_padding=remove_padding, use_dynamic_bsz=False, micro_batch_size_per_gpu=2,
                         use_fused_kernels=False, temperature=1.0, global_batch_size=b)
    return td, ids, mask


@pytest.mark.parametrize("remove_padding", [True, False])
@pytest.mark.usefixtures("verl_cpu")
def test_verls_critic_engine_loads_scores_and_trains_our_value_head(ckpt, remove_padding):
    engine = critic_engine(ckpt, remove_padding)
    critic = engine.module
    arch = get("qwen3")
    assert type(critic) is arch.token_classification_class and critic.config.num_labels == 1
    policy = arch.causal_lm_class.from_pretrained(ckpt)
    assert all(torch.equal(p, policy.model.state_dict()[n]) for n, p in critic.model.state_dict().items())
    assert critic.is_gradient_checkpointing  # verl's enable_gradient_checkpointing reached our layers

    td, ids, mask = batch(remove_padding)
    critic.eval()
    values = no_padding_2_padding(engine.infer_batch(td)["model_output"]["values"], td)
    with torch.no_grad():
        want = critic(ids, attention_mask=mask).logits.squeeze(-1)[:, P - 1:-1]
    response = td["response_mask"].bool()
    assert values.shape == want.shape and torch.allclose(values[response], want[response], atol=1e-6)

    critic.train()
    score = critic.score.weight.detach().clone()
    td, _, _ = batch(remove_padding)
    out = engine.train_batch(td, loss_function=partial(value_loss, config=CriticConfig(
        strategy="fsdp2", ppo_micro_batch_size_per_gpu=2, ppo_mini_batch_size=4, rollout_n=1)))
    losses = out["metrics"]["critic/vf_loss"]  # one verl Metric per micro-batch
    losses = [float(v) for m in (losses if isinstance(losses, list) else [losses]) for v in m.values]
    assert losses and all(torch.isfinite(torch.tensor(losses)))
    assert not torch.equal(critic.score.weight, score)  # verl's optimizer step moved the value head
