"""TRL integration: trl's own GRPOTrainer (VexactGRPOTrainer) trains our model with rollouts from
vexact_models.LLM, and TRL's own mismatch metrics read exactly 0 / 1; with the integration's
logprobs switched off they do not."""


import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("datasets")

from trl import GRPOConfig  # noqa: E402

from vexact_models.integrations.trl import (VexactDistillationTrainer, VexactGRPOTrainer,  # noqa: E402
                                            VexactRLOOTrainer)

from .trl_support import DIFF_MAX, DIFF_MEAN, IS_MAX, IS_MEAN, IS_MIN, grpo_trainer, trl_layout  # noqa: E402


@pytest.fixture(scope="module")
def example(trl_grpo_example):
    """examples/trl_grpo.py as a module (tests/integrations/conftest.py)."""
    return trl_grpo_example


def test_trl_metrics_zero_with_integration_nonzero_without(example, tmp_path):
    args = example.parse_args(["--steps", "3", "--out", str(tmp_path / "exact")])
    exact = example.run(args)
    assert [h["step"] for h in exact] == [1, 2, 3]
    for h in exact:  # TRL's own metrics, logged every step
        assert h[DIFF_MAX] == 0.0 and h[DIFF_MEAN] == 0.0, h
        assert h[IS_MIN] == 1.0 and h[IS_MEAN] == 1.0 and h[IS_MAX] == 1.0, h
        assert h["clip_ratio/region_mean"] == 0.0 and h["entropy"] > 0
    off = example.run(example.parse_args(["--steps", "3", "--mode", "trl-logprobs", "--out", str(tmp_path / "off")]))
    assert len(off) == 3
    assert all(h[DIFF_MAX] > 0 for h in off), [h[DIFF_MAX] for h in off]
    assert all(h[DIFF_MAX] < 1e-4 for h in off)  # fp32 rounding differences, not a bug
    # same seeds, same rollout engine: the first step samples the same completions either way
    assert off[0]["reward"] == exact[0]["reward"]


def test_the_example_trains_lora_adapters_with_trl_metrics_at_zero(example, tmp_path, capsys):
    """``examples/trl_grpo.py --lora 4``: TRL's metrics read 0 / 1 every step; ``--lora 0`` is
    refused naming the flag."""
    assert example.main(["--steps", "2", "--lora", "4", "--out", str(tmp_path)]) == 0
    assert "max 0" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        example.parse_args(["--lora", "0"])
    assert "--lora" in capsys.readouterr().err


@pytest.mark.parametrize("arch_name, overrides", [("qwen3", {}), ("qwen3_moe", {}), ("qwen3_5", {}),
                                                ("gemma3", {"final_logit_softcapping": 3.0})],
                         ids=["qwen3", "qwen3_moe", "qwen3_5", "gemma3-softcap"])
def test_trainer_logprobs_equal_rollout_logprobs_bitwise(example, arch_name, overrides, tmp_path):
    """TRL's `_get_per_token_logps_and_entropies` (its padded layout) on a rollout of the
    trainer's generation backend gives the rollout's logprobs bitwise (Qwen3.5: the gated-DeltaNet
    hybrid, its states kept by the engine; Gemma 3 with its final logit soft cap, which the fused
    head applies as the sampler's logits do); for Qwen3-MoE also the model's own load-balancing
    loss, which TRL adds by default."""
    from vexact_models.registry import architectures

    if arch_name not in {arch.name for arch in architectures()}:
        pytest.skip(f"{arch_name} is not registered on this transformers")
    trainer = grpo_trainer(example, arch_name, tmp_path, **overrides)
    model = trainer.model
    assert type(model).__module__.startswith("vexact_models.")  # a path string loads our class, not the stock one
    gen = trainer.vllm_generation
    assert gen.shares_weights and gen.llm.model.causal_lm is model
    gen.sync_weights()  # shared storage: nothing to copy
    prompts = [[3, 4, 5], [9, 2, 2, 7, 11], [6]] * 2
    prompt_ids, completion_ids, nested, _ = gen.generate(prompts, num_generations=2)
    _, _, rollout_lps = gen.last_rollout
    assert [[x[0] for x in seq] for seq in nested] == rollout_lps
    ids, mask, expected, cmask = trl_layout(prompt_ids, completion_ids, rollout_lps)
    aux = arch_name == "qwen3_moe"
    assert trainer.aux_loss_enabled == aux
    with torch.no_grad():
        logps, entropies, aux_loss = trainer._get_per_token_logps_and_entropies(
            model, ids, mask, expected.shape[1], compute_entropy=True, compute_aux_loss=aux)
    assert torch.equal(logps[cmask], expected[cmask])
    assert torch.equal(logps[~cmask], torch.zeros_like(logps[~cmask]))
    assert entropies.shape == logps.shape and bool((entropies[cmask] > 0).all())
    assert torch.equal(model.token_logprobs(ids, mask)[:, -expected.shape[1]:][cmask], expected[cmask])
    if aux:
        reference = model(input_ids=ids, attention_mask=mask, output_router_logits=True).aux_loss
        assert torch.equal(aux_loss, reference)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer.train()  # two optimizer steps (the MoE one with its load-balancing loss) keep TRL's metrics at 0 / 1
    logs = [h for h in trainer.state.log_history if DIFF_MAX in h]
    assert len(logs) == 2 and all(h[DIFF_MAX] == 0.0 and h[IS_MIN] == h[IS_MAX] == 1.0 for h in logs), logs
    assert ("aux_loss" in logs[0]) == aux
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())  # it did train


def test_the_repeats_trl_makes_of_a_prompt_take_its_state_on_a_hybrid(example, tmp_path):
    """The default engine of a gated-DeltaNet hybrid keeps a state for each distinct prompt of the
    generation batch (8 completions, 4 generations a prompt: 2), so TRL's repeats of a prompt take
    its first one's state instead of prefilling it again; a dense model's keeps none."""
    trainer = grpo_trainer(example, "qwen3_5", tmp_path)
    llm = trainer.vllm_generation.llm
    assert llm.scheduler.prefix_states == 2
    block = llm.block_manager.block_size
    prompts = [[(7 * j) % 13 + 2 for j in range(2 * block + 3)]] * 4 + [[(5 * j) % 11 + 2 for j in range(block + 1)]] * 4
    trainer.vllm_generation.generate(prompts, num_generations=4)
    assert llm.scheduler.num_prefix_state_tokens == 3 * 2 * block + 3 * block
    assert grpo_trainer(example, "qwen3", tmp_path / "dense").vllm_generation.llm.scheduler.prefix_states == 0


@pytest.mark.parametrize("arch_name", ["qwen3_5_moe", "gemma3"])
def test_a_published_multimodal_checkpoint_trains_its_text_model(example, arch_name, tmp_path):
    """Given the path of a published-style multimodal checkpoint (Qwen3.5, Gemma 3 4B+), the trainer
    trains our text model (the vision tower skipped), with TRL's metrics at 0 / 1."""
    from vexact_models.registry import architectures

    served = {arch.name: arch for arch in architectures()}
    if arch_name not in served:
        pytest.skip(f"{arch_name} is not registered on this transformers")
    trainer = grpo_trainer(example, arch_name, tmp_path, multimodal=True)
    assert type(trainer.model) is served[arch_name].causal_lm_class
    trainer.train()
    logs = [h for h in trainer.state.log_history if DIFF_MAX in h]
    assert len(logs) == 2 and all(h[DIFF_MAX] == 0.0 and h[IS_MIN] == h[IS_MAX] == 1.0 for h in logs), logs


@pytest.mark.parametrize("grpo", [{"loss_type": t} for t in ("grpo", "dr_grpo", "bnpo", "cispo", "sapo", "luspo")]
                         + [{"loss_type": "vespo", "vllm_importance_sampling_mode": "token_mask"},  # (TRL's rule for VESPO)
                            {"importance_sampling_level": "sequence"}, {"num_iterations": 2}, {"steps_per_generation": 2},
                            {"top_entropy_quantile": 0.5}, {"off_policy_mask_threshold": 0.5}, {"delta": 1.5},
                            {"mask_truncated_completions": True}, {"vllm_importance_sampling_mode": "token_truncate"}],
                         ids=lambda g: "-".join(f"{k}={v}" for k, v in g.items()))
def test_trls_loss_variants_train_with_the_metrics_exact(example, grpo, tmp_path):
    """TRL's other objectives and options (every ``loss_type``, GSPO's sequence-level ratio,
    several iterations or steps a generation, the entropy mask, the off-policy mask, two-sided
    clipping) score tokens through the same exact head: the metrics read 0 / 1 at every step."""
    trainer = grpo_trainer(example, "qwen3", tmp_path, grpo=grpo)
    trainer.train()
    logs = [h for h in trainer.state.log_history if DIFF_MAX in h]
    assert logs and all(h[DIFF_MAX] == 0.0 and h[IS_MIN] == h[IS_MAX] == 1.0 for h in logs), logs


LORA = {"qwen3": dict(target_modules="all-linear"),
        "qwen3_moe": dict(target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                          target_parameters=["experts.gate_up_proj", "experts.down_proj"])}


@pytest.mark.parametrize("arch_name, beta, checkpointing", [("qwen3", 0.0, False), ("qwen3", 0.1, True),
                                                             ("qwen3_moe", 0.0, False)],
                         ids=["qwen3", "qwen3-kl-checkpointing", "qwen3_moe-experts"])
def test_lora_rollouts_equal_trainer_logprobs_and_only_the_adapters_train(example, arch_name, beta, checkpointing,
                                                                         tmp_path):
    """``peft_config=LoraConfig(...)`` (random adapters, PEFT's ``init_lora_weights=False``): the
    engine runs the PeftModel's own parameters, adapters included; TRL's logprobs of a rollout
    equal the rollout's bitwise, and with the adapters disabled (the reference model TRL uses
    for ``beta > 0``) the base model's ``token_logprobs``; two optimizer steps keep TRL's metrics
    at 0 / 1 and change the adapters only (Qwen3-MoE: the fused experts adapted too; with
    gradient checkpointing, which TRL pairs with PEFT's ``enable_input_require_grads``, too)."""
    from peft import LoraConfig, PeftModel

    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False, **LORA[arch_name])
    trainer = grpo_trainer(example, arch_name, tmp_path, beta=beta, peft_config=lora, gradient_checkpointing=checkpointing)
    model = trainer.model
    assert isinstance(model, PeftModel) and type(model.get_base_model()).__module__.startswith("vexact_models.")
    gen = trainer.vllm_generation
    assert gen.shares_weights and gen.llm.model.causal_lm is model.get_base_model()
    prompt_ids, completion_ids, _, _ = gen.generate([[3, 4, 5], [9, 2, 2, 7, 11], [6]] * 2)
    ids, mask, expected, cmask = trl_layout(prompt_ids, completion_ids, gen.last_rollout[2])
    width = expected.shape[1]
    with torch.no_grad():
        logps = trainer._get_per_token_logps_and_entropies(model, ids, mask, width)[0]
        with model.disable_adapter():
            reference = trainer._get_per_token_logps_and_entropies(model, ids, mask, width)[0]
            base = model.get_base_model().token_logprobs(ids, mask)[:, -width:]
    assert torch.equal(logps[cmask], expected[cmask])
    assert torch.equal(reference[cmask], base[cmask]) and not torch.equal(reference[cmask], logps[cmask])
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer.train()
    assert model.get_base_model().model.gradient_checkpointing == checkpointing  # the Trainer turns it on in train()
    logs = [h for h in trainer.state.log_history if DIFF_MAX in h]
    assert len(logs) == 2 and all(h[DIFF_MAX] == 0.0 and h[IS_MIN] == h[IS_MAX] == 1.0 for h in logs), logs
    assert (logs[0].get("kl", 0.0) > 0) == (beta > 0)  # random adapters: the policy is not the reference
    changed = {k for k, v in model.state_dict().items() if not torch.equal(before[k], v)}
    assert changed and all("lora_" in k for k in changed), sorted(changed)[:5]
    if arch_name == "qwen3_moe":
        assert any("experts" in k for k in changed)


def test_a_peft_model_of_ours_trains_against_trls_reference_adapter(example, tmp_path):
    """A ``PeftModel`` over ours with ``beta > 0``: TRL copies its adapter into a frozen "ref"
    adapter and switches to it for the reference logprobs; rollouts keep sampling from the
    trained "default" one, so TRL's mismatch metrics stay 0 / 1 while its KL starts at 0 and grows."""
    from peft import LoraConfig, get_peft_model

    from vexact_models.registry import get

    arch = get("qwen3")
    config = arch.tiny_config(vocab_size=16)
    torch.manual_seed(0)
    model = get_peft_model(arch.causal_lm_class(config), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                                    lora_dropout=0.0, init_lora_weights=False))
    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4, max_completion_length=5,
                      max_steps=2, logging_steps=1, save_strategy="no", learning_rate=5e-2, report_to=[], use_cpu=True,
                      bf16=False, gradient_checkpointing=False, disable_tqdm=True, beta=0.1)
    trainer = VexactGRPOTrainer(model, reward_funcs=example.repeat_last_token, args=args,
                                processing_class=example.toy_tokenizer(config), llm_kwargs={"kv_cache_bytes": 16 << 20},
                                train_dataset=example.toy_dataset(example.parse_args(["--steps", "1"]), 16))
    assert set(trainer.model.peft_config) == {"default", "ref"} and trainer.vllm_generation.shares_weights
    trainer.train()
    logs = [h for h in trainer.state.log_history if DIFF_MAX in h]
    assert len(logs) == 2 and all(h[DIFF_MAX] == 0.0 and h[IS_MIN] == h[IS_MAX] == 1.0 for h in logs), logs
    assert logs[0]["kl"] == 0.0 and logs[1]["kl"] > 0.0


def test_bad_settings_are_refused_before_building(example, tmp_path):
    import transformers
    from transformers.models.qwen3.modeling_qwen3 import Qwen3ForCausalLM

    from vexact_models import LLM
    from vexact_models.registry import get

    import vexact_models.qwen3 as qwen3

    config = qwen3.tiny_config(vocab_size=16)
    ours = qwen3.Qwen3ForCausalLM(config)
    common = dict(reward_funcs=example.repeat_last_token, processing_class=example.toy_tokenizer(config))
    base = dict(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4, report_to=[],
                use_cpu=True, bf16=False)
    with pytest.raises(ValueError, match="use_vllm=True"):
        VexactGRPOTrainer(ours, args=GRPOConfig(**base, use_vllm=True), **common)
    with pytest.raises(ValueError, match="use_liger_kernel=True"):
        VexactGRPOTrainer(ours, args=GRPOConfig(**base, use_liger_kernel=True), **common)
    bare = LLM(qwen3.Qwen3ForCausalLM(config), device="cpu", kv_cache_bytes=1 << 20)
    with pytest.raises(ValueError, match=r"generation_kwargs\['stop'\] \(stop strings\) needs the engine's tokenizer"):
        VexactGRPOTrainer(ours, args=GRPOConfig(**base, generation_kwargs={"stop": ["x"]}), llm=bare, **common)
    with pytest.raises(ValueError, match=r"generation_kwargs \['truncate_prompt_tokens'\] \(only \['stop'"):
        VexactGRPOTrainer(ours, args=GRPOConfig(**base, generation_kwargs={"stop": ["x"], "truncate_prompt_tokens": 8}),
                          **common)
    with pytest.raises(ValueError, match="loss_type='vespo' with vllm_importance_sampling_mode='sequence_mask'"):
        VexactGRPOTrainer(ours, args=GRPOConfig(**base, loss_type="vespo", vllm_importance_sampling_mode="sequence_mask"),
                          **common)
    with pytest.raises(ValueError, match="transformers.models.qwen3.modeling_qwen3.Qwen3ForCausalLM"):
        VexactGRPOTrainer(Qwen3ForCausalLM(config), args=GRPOConfig(**base), **common)
    multimodal = transformers.Qwen3_5Config(text_config=get("qwen3_5").tiny_config(vocab_size=16).to_dict())
    with pytest.raises(ValueError, match=r"multimodal .*Qwen3_5ForConditionalGeneration.*vexact_models\.qwen3_5\."
                                         r"Qwen3_5ForCausalLM\.from_pretrained\(path\)"):
        VexactGRPOTrainer(transformers.Qwen3_5ForConditionalGeneration(multimodal), args=GRPOConfig(**base), **common)
    assert "forward" not in vars(ours)  # refused before anything was patched onto the model


@pytest.mark.parametrize("arch_name", ["qwen3", "qwen3_5"])
def test_rloo_trains_on_the_engines_rollouts_with_trls_logprobs_equal_to_them(example, arch_name, tmp_path):
    """`VexactRLOOTrainer` (TRL's ``RLOOTrainer``) from a checkpoint path: our class, its rollouts
    from the engine sharing the policy's weights, and TRL's own per-token logprobs of them (its
    padded layout, through the exact head) the rollout's bitwise; two optimizer steps train it;
    its settings are refused as `VexactGRPOTrainer`'s are."""
    from trl import RLOOConfig

    from vexact_models.registry import architectures, get

    if arch_name not in {arch.name for arch in architectures()}:
        pytest.skip(f"{arch_name} is not registered on this transformers")
    config = get(arch_name).tiny_config(vocab_size=16)
    torch.manual_seed(0)
    get(arch_name).causal_lm_class(config).save_pretrained(tmp_path / "ckpt")
    base = dict(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4, max_completion_length=5,
                logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, bf16=False, disable_tqdm=True)
    common = dict(reward_funcs=example.repeat_last_token, processing_class=example.toy_tokenizer(config),
                  train_dataset=example.toy_dataset(example.parse_args(["--steps", "1"]), 16),
                  llm_kwargs={"kv_cache_bytes": 16 << 20})
    trainer = VexactRLOOTrainer(str(tmp_path / "ckpt"), args=RLOOConfig(**base, max_steps=2, learning_rate=1e-2),
                                **common)
    model = trainer.model
    assert type(model).__module__.startswith("vexact_models.") and trainer.vllm_generation.shares_weights
    prompts = [[3, 4, 5], [9, 2, 2, 7, 11], [6]] * 2
    prompt_ids, completion_ids, _, _ = trainer.vllm_generation.generate(prompts, num_generations=2)
    ids, mask, expected, cmask = trl_layout(prompt_ids, completion_ids, trainer.vllm_generation.last_rollout[2])
    with torch.no_grad():
        logps, _, _ = trainer._get_per_token_logps_and_entropies(model, ids, mask, expected.shape[1])
    assert torch.equal(logps[cmask], expected[cmask])
    before = {k: v.clone() for k, v in model.state_dict().items()}
    calls = []
    generate = trainer.vllm_generation.llm.generate
    trainer.vllm_generation.llm.generate = lambda *a, **kw: calls.append(1) or generate(*a, **kw)
    trainer.train()
    assert trainer.state.global_step == 2 and calls  # TRL's steps generated on the engine
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())
    with pytest.raises(ValueError, match=r"VexactRLOOTrainer: unsupported RLOOConfig setting\(s\): use_vllm=True"):
        VexactRLOOTrainer(str(tmp_path / "ckpt"), args=RLOOConfig(**base, use_vllm=True), **common)


def test_on_policy_distillation_samples_the_student_on_the_engine(example, tmp_path):
    """`VexactDistillationTrainer` (TRL's ``DistillationTrainer``) from a student and a teacher
    path: our class for the student, its completions from the engine over its own weights, their
    logprobs the student's ``token_logprobs`` bitwise (samples of exactly the distribution it
    trains), every training step generating there."""
    from trl import DistillationConfig

    from vexact_models.registry import get

    config = get("qwen3").tiny_config(vocab_size=16)
    for seed, name in ((0, "student"), (1, "teacher")):
        torch.manual_seed(seed)
        get("qwen3").causal_lm_class(config).save_pretrained(tmp_path / name)
    args = DistillationConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, max_completion_length=5,
                              max_steps=2, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, bf16=False,
                              disable_tqdm=True, learning_rate=1e-2)
    trainer = VexactDistillationTrainer(str(tmp_path / "student"), str(tmp_path / "teacher"), args=args,
                                        processing_class=example.toy_tokenizer(config),
                                        train_dataset=example.toy_dataset(example.parse_args(["--steps", "1"]), 16),
                                        llm_kwargs={"kv_cache_bytes": 16 << 20})
    student, gen = trainer.model, trainer.vllm_generation
    assert type(student).__module__.startswith("vexact_models.") and gen.shares_weights
    prompt_ids, completion_ids, _, _ = gen.generate([[3, 4, 5], [9, 2, 2, 7, 11]], num_generations=1)
    for p, c, lps in zip(prompt_ids, completion_ids, gen.last_rollout[2]):
        with torch.no_grad():
            ref = student.token_logprobs(torch.tensor([p + c]), temperature=args.temperature)[0, len(p):]
        assert torch.equal(ref, torch.tensor(lps))
    calls = []
    generate = gen.llm.generate
    gen.llm.generate = lambda *a, **kw: calls.append(1) or generate(*a, **kw)
    before = {k: v.clone() for k, v in student.state_dict().items()}
    trainer.train()
    assert trainer.state.global_step == 2 and len(calls) >= 2
    assert any(not torch.equal(before[k], v) for k, v in student.state_dict().items())


def test_the_examples_patched_cb_mode_rolls_out_stock_trl_on_the_engine(example, tmp_path, monkeypatch):
    """``examples/trl_grpo.py --mode patched-cb``: plain ``trl.GRPOTrainer`` on our class with
    ``use_transformers_continuous_batching``: every step's completions come from the rollout
    engine (one `LLM.generate` a step, all of the step's prompts), and it trains."""
    from vexact_models.runtime import LLM

    calls, generate = [], LLM.generate
    monkeypatch.setattr(LLM, "generate", lambda self, *a, **k: calls.append(len(a[0])) or generate(self, *a, **k))
    args = example.parse_args(["--mode", "patched-cb", "--steps", "2", "--out", str(tmp_path)])
    logs = example.run(args)
    assert [h["step"] for h in logs] == [1, 2] and calls == [args.prompts * args.group] * 2
    assert all("sampling/sampling_logp_difference/max" not in h for h in logs)  # TRL reads no sampler logprobs there
