"""verl integration (``vexact_models.integrations.verl``), the actor side, against verl's own
classes: verl's actor computes the rollout's logprobs bitwise (its ``rollout_probs_diff_max`` is
0), and is not 0 with the integration off.

Runs where verl imports (``.ci/verl`` builds that venv: verl 0.9.1 pins transformers < 5.11);
skipped elsewhere. verl's FSDP engine needs an accelerator platform: the tests give it a CPU one
through verl's platform extension point (`set_platform`), and run the engine's own input
preparation, forward and output unpacking on the unsharded module (FSDP wrapping itself needs a
GPU; ``docs/verl.md`` says how to run the full trainer there). The rollout side is
`test_verl_rollout.py`.
"""

import asyncio
import sys
from pathlib import Path

import pytest
import torch

vv = pytest.importorskip("vexact_models.integrations.verl", reason="verl (and ray) not importable here",
                         exc_type=ImportError)

# pytest's importlib mode does not put this folder on sys.path; the shared helpers live beside
sys.path.insert(0, str(Path(__file__).parent))
from verl import DataProto  # noqa: E402
from verl.trainer.config import CheckpointConfig  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.utils.debug.metrics import calculate_debug_metrics  # noqa: E402
from verl.utils.model import compute_position_id_with_mask  # noqa: E402
from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig  # noqa: E402
from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding  # noqa: E402
from verl_support import P, PROMPTS, R, TEMP, generate_all, make_rollout, model_config, save_tiny  # noqa: E402
from verl_support import verl_cpu  # noqa: E402, F401  (a fixture, shared with test_verl_critic.py)

import vexact_models  # noqa: E402
from vexact_models.registry import get  # noqa: E402


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_tiny(tmp_path_factory, "qwen3")


# ----------------------------------------------------------------------------------------------
# the actor side: verl's own log-prob computation and metric
# ----------------------------------------------------------------------------------------------

def verl_engine(path: str, fused: bool, remove_padding: bool = True, **lora):
    """verl's FSDP actor engine, its module built by verl's own loader (AutoModelForCausalLM and
    verl's monkey patches; PEFT LoRA for `lora`'s ``lora_rank``...), left unsharded on CPU."""
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    # impl_backend="torch": verl's YAML default, under which verl replaces a model's forward with its own
    # fused-linear one (for every class but ours, once installed)
    mc = model_config(path, use_remove_padding=remove_padding, use_fused_kernels=fused,
                      fused_kernel_options={"impl_backend": "torch"}, enable_gradient_checkpointing=False,
                      override_config={"attn_implementation": "sdpa"}, **lora)
    engine = FSDPEngineWithLMHead(mc, FSDPEngineConfig(forward_only=True, use_torch_compile=False, model_dtype="fp32"),
                                  FSDPOptimizerConfig(lr=1e-5), CheckpointConfig())
    engine.module = engine._build_module()
    if lora:  # what verl's _build_model_optimizer does next for LoRA
        engine.module = engine._build_lora_module(engine.module)
    engine._autocast_dtype = torch.float32  # FSDP's mixed precision is not set up without sharding
    return engine


def rollout_batch(outs: list) -> dict:
    """verl's rollout batch layout (its agent loop's): left-padded prompts, right-padded responses."""
    b = len(PROMPTS)
    prompts, responses = torch.zeros(b, P, dtype=torch.long), torch.zeros(b, R, dtype=torch.long)
    mask, rollout_lp = torch.zeros(b, P + R, dtype=torch.long), torch.zeros(b, R)
    for i, (prompt, out) in enumerate(zip(PROMPTS, outs)):
        n = len(out.token_ids)
        prompts[i, P - len(prompt):] = torch.tensor(prompt)
        responses[i, :n] = torch.tensor(out.token_ids)
        mask[i, P - len(prompt):P + n] = 1
        rollout_lp[i, :n] = torch.tensor(out.log_probs)
    return {"prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], 1),
            "attention_mask": mask, "position_ids": compute_position_id_with_mask(mask),
            "response_mask": mask[:, P:], "rollout_log_probs": rollout_lp}


def actor_old_log_probs(engine, tensors: dict, fused: bool, remove_padding: bool = True) -> torch.Tensor:
    """verl's ``_compute_old_log_prob`` without the Ray hop: padding removed, the engine's
    ``infer_batch`` in micro-batches of 2, the response slice taken back."""
    td = left_right_2_no_padding(DataProto.from_dict(tensors=dict(tensors)).to_tensordict())
    tu.assign_non_tensor(td, calculate_entropy=True, compute_loss=False, temperature=TEMP, use_fused_kernels=fused,
                         use_remove_padding=remove_padding, use_dynamic_bsz=False, micro_batch_size_per_gpu=2)
    return no_padding_2_padding(engine.infer_batch(td)["model_output"]["log_probs"], td).float()


def diff_metrics(tensors: dict, old_log_probs: torch.Tensor) -> dict:
    return calculate_debug_metrics(DataProto.from_dict(tensors={**tensors, "old_log_probs": old_log_probs}))


@pytest.mark.parametrize("remove_padding", [True, False])
@pytest.mark.usefixtures("verl_cpu")
def test_actor_logprobs_equal_rollout_and_verls_metric_is_zero(ckpt, remove_padding):
    _, server = make_rollout(ckpt)
    tensors = rollout_batch(asyncio.run(generate_all(server)))
    engine = verl_engine(ckpt, fused=True, remove_padding=remove_padding)
    assert type(engine.module) is get("qwen3").causal_lm_class
    old = actor_old_log_probs(engine, tensors, fused=True, remove_padding=remove_padding)
    assert torch.equal(old * tensors["response_mask"], tensors["rollout_log_probs"])
    metrics = diff_metrics(tensors, old)
    assert metrics["training/rollout_probs_diff_valid"] == 1
    assert metrics["training/rollout_probs_diff_max"] == 0.0


@pytest.mark.usefixtures("verl_cpu")
def test_an_exported_multimodal_checkpoint_trains_as_our_text_model(tmp_path):
    """verl builds a published-style multimodal Qwen3.5 checkpoint's actor as the multimodal model
    (its loader picks AutoModelForImageTextToText); from its ``vexact export-text`` export, verl's
    own loader builds our text class, whose logprobs equal the rollout's bitwise."""
    from transformers import AutoConfig
    from verl.utils.model import get_hf_auto_model_class

    from vexact_models.text_export import export_text_model

    from ..models.model_support import save_multimodal

    arch = get("qwen3_5")
    save_multimodal(arch, arch.tiny_config(initializer_range=0.5), tmp_path / "multimodal")
    auto = get_hf_auto_model_class(AutoConfig.from_pretrained(tmp_path / "multimodal"))
    assert auto.__name__ in ("AutoModelForImageTextToText", "AutoModelForVision2Seq")
    path = str(export_text_model(tmp_path / "multimodal", tmp_path / "text", progress=False))
    _, server = make_rollout(path, engine={"kv_cache_bytes": 8 << 20})
    tensors = rollout_batch(asyncio.run(generate_all(server)))
    engine = verl_engine(path, fused=True)
    assert type(engine.module) is arch.causal_lm_class
    old = actor_old_log_probs(engine, tensors, fused=True)
    assert torch.equal(old * tensors["response_mask"], tensors["rollout_log_probs"])


@pytest.fixture(scope="module")
def moe_ckpt(tmp_path_factory):
    return save_tiny(tmp_path_factory, "qwen3_moe")


@pytest.mark.parametrize("arch_name", ["qwen3", "qwen3_moe"])
@pytest.mark.usefixtures("verl_cpu")
def test_unmerged_lora_adapters_stream_to_the_rollout_and_the_actor_scores_it_bitwise(arch_name, request):
    """``lora.merge=False``: verl's actor engine (a PeftModel of ours, LoRA r 4 on every linear
    layer; Qwen3-MoE's fused experts too) hands the rollout its adapters alone (its own ``get_per_tensor_param``, as verl's
    worker calls it each step); the engine takes adapters of verl's ``peft_config`` and its
    logprobs equal the actor's bitwise, after a second sync of other adapter values too. verl's
    one-time base sync (``base_sync_done=False``: LoRA's ``base_layer`` names) loads as well; a
    later ``peft_config`` of another rank is refused naming the field."""
    ckpt = request.getfixturevalue("ckpt" if arch_name == "qwen3" else "moe_ckpt")
    experts = {"target_parameters": ["experts.gate_up_proj", "experts.down_proj"]} if arch_name == "qwen3_moe" else {}
    engine = verl_engine(ckpt, fused=True, lora_rank=4, lora_alpha=8, lora={"merge": False}, **experts)
    peft_model = engine.module
    assert type(peft_model.get_base_model()) is get(arch_name).causal_lm_class
    rollout, server = make_rollout(ckpt)
    base, base_config = engine.get_per_tensor_param(layered_summon=False, base_sync_done=False)
    asyncio.run(rollout.update_weights(base, peft_config=base_config, base_sync_done=False))
    for step in range(2):
        with torch.no_grad():  # "a training step": adapters the rollout has not seen
            for name, p in peft_model.named_parameters():
                if "lora_" in name:
                    p.normal_(0.0, 0.2)
        params, peft_config = engine.get_per_tensor_param(layered_summon=False, base_sync_done=True)
        assert isinstance(peft_config, dict) and all("lora_" in n for n, _ in dict(params).items())
        asyncio.run(rollout.update_weights(params, peft_config=peft_config, base_sync_done=True, global_steps=step))
        tensors = rollout_batch(asyncio.run(generate_all(server)))
        old = actor_old_log_probs(engine, tensors, fused=True)
        assert torch.equal(old * tensors["response_mask"], tensors["rollout_log_probs"]), step
        assert diff_metrics(tensors, old)["training/rollout_probs_diff_max"] == 0.0
        with peft_model.disable_adapter():  # the adapters do change the logprobs
            assert not torch.equal(actor_old_log_probs(engine, tensors, fused=True), old)
    with pytest.raises(ValueError, match=r"peft_config differs .* \['r'\]"):
        asyncio.run(rollout.update_weights(iter([]), peft_config={**peft_config, "r": 8}, base_sync_done=True))


@pytest.mark.parametrize("variant", ["stock transformers class", "our class, verl's fused path"])
@pytest.mark.usefixtures("verl_cpu")
def test_verls_metric_is_nonzero_without_the_hook(ckpt, variant):
    """The same rollout scored by verl's stock paths, integration uninstalled: the stock
    transformers class with verl's log-softmax, or our class (same kernels up to the hidden
    states) with verl's own fused-linear forward, which verl installs over ours. Neither is 0:
    the hook is what makes the metric 0."""
    _, server = make_rollout(ckpt)
    tensors = rollout_batch(asyncio.run(generate_all(server)))
    ours = get("qwen3").causal_lm_class
    fused = variant != "stock transformers class"
    vv.uninstall()
    own_forward = ours.__dict__.get("forward")
    (vexact_models.patch if fused else vexact_models.unpatch)()
    try:
        engine = verl_engine(ckpt, fused=fused)
        assert (type(engine.module) is ours) == fused
        if fused:
            assert ours.forward is not own_forward  # verl replaced it
        old = actor_old_log_probs(engine, tensors, fused=fused)
    finally:
        if own_forward is not None:  # put back what verl replaced
            ours.forward = own_forward
        elif "forward" in ours.__dict__:
            del ours.forward
        vexact_models.unpatch()
        vv.install()
    metrics = diff_metrics(tensors, old)
    assert metrics["training/rollout_probs_diff_valid"] == 1
    assert metrics["training/rollout_probs_diff_max"] > 0.0
    # the same model, only not bitwise: it agrees to float32 noise
    assert torch.allclose(old * tensors["response_mask"], tensors["rollout_log_probs"], atol=1e-4)


def test_hook_forward_is_differentiable_with_verls_layout(ckpt):
    """verl's fused-kernel call (packed ids, positions restarting at 0, globally rolled labels):
    ``log_probs[t]`` is the logprob of ``shift_labels[t]``, equal to `token_logprobs` one token on,
    with gradients, and ``entropy`` is the distribution's entropy."""
    model = get("qwen3").causal_lm_class.from_pretrained(ckpt)
    seqs = [torch.tensor(s) for s in ([3, 4, 5, 6], [7, 8, 9], [10, 11, 12, 13, 14])]
    ids = torch.cat(seqs)[None]
    positions = torch.cat([torch.arange(len(s)) for s in seqs])[None]
    out = model(input_ids=ids, position_ids=positions, temperature=TEMP, shift_labels=torch.roll(ids, -1, dims=1),
                return_dict=True, use_cache=False)
    (out.log_probs.sum() + out.entropy.sum()).backward()
    assert model.model.embed_tokens.weight.grad.abs().sum() > 0
    with torch.no_grad():
        expected = model.token_logprobs(ids, position_ids=positions, temperature=TEMP)
        logits = model(input_ids=ids, position_ids=positions).logits[0] / TEMP
    last = torch.cumsum(torch.tensor([len(s) for s in seqs]), 0) - 1  # each sequence's last token
    keep = torch.ones(ids.shape[1], dtype=torch.bool)
    keep[last] = False
    assert torch.equal(out.log_probs.detach()[0, :-1][keep[:-1]], expected[0, 1:][keep[:-1]])
    entropy = -(logits.log_softmax(-1).exp() * logits.log_softmax(-1)).sum(-1)
    assert torch.allclose(out.entropy.detach()[0], entropy, atol=1e-5)
    plain = model(input_ids=ids, position_ids=positions)  # without temperature: the ordinary forward
    assert plain.logits.shape == (1, ids.shape[1], model.config.vocab_size)
