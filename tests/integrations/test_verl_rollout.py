"""verl integration (``vexact_models.integrations.verl``), the rollout side, against verl's own
classes: registration, verl's rollout contract (generate / release / resume / update_weights /
abort), bad input, and the replica under Ray.

Runs where verl imports (``.ci/verl`` builds that venv: verl 0.9.1 pins transformers < 5.11);
skipped elsewhere. The actor side is `test_verl_actor.py`.
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
from transformers import AutoModelForCausalLM  # noqa: E402
from verl.workers.engine.fsdp.utils import unfuse_moe_params  # noqa: E402
from verl.workers.rollout import base as verl_rollout_base  # noqa: E402
from verl.workers.rollout.base import BaseRollout, get_rollout_class  # noqa: E402
from verl.workers.rollout.replica import RolloutReplica, RolloutReplicaRegistry, TokenOutput  # noqa: E402
from verl_support import (MAX_TOKENS, PARAMS, PROMPTS, R, generate_all, make_rollout, model_config,  # noqa: E402
                          recompute, rollout_config, save_tiny)

from vexact_models.registry import get  # noqa: E402


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_tiny(tmp_path_factory, "qwen3")


# ----------------------------------------------------------------------------------------------
# registration
# ----------------------------------------------------------------------------------------------

def test_registered_with_verl(ckpt):
    arch = get("qwen3")
    rollout_cls = get_rollout_class(vv.ROLLOUT_NAME, "async")
    assert rollout_cls is vv.VexactRollout and issubclass(rollout_cls, BaseRollout)
    replica_cls = RolloutReplicaRegistry.get(vv.ROLLOUT_NAME)
    assert replica_cls is vv.VexactReplica and issubclass(replica_cls, RolloutReplica)
    assert type(AutoModelForCausalLM.from_pretrained(ckpt)) is arch.causal_lm_class  # verl loads ours
    vv.uninstall()
    try:
        assert (vv.ROLLOUT_NAME, "async") not in verl_rollout_base._ROLLOUT_REGISTRY
        with pytest.raises(ValueError, match="Unknown rollout mode"):
            RolloutReplicaRegistry.get(vv.ROLLOUT_NAME)
        assert not hasattr(arch.causal_lm_class.forward, "_vexact_verl_original")
        assert type(AutoModelForCausalLM.from_pretrained(ckpt)) is not arch.causal_lm_class
    finally:
        vv.install()
    assert get_rollout_class(vv.ROLLOUT_NAME, "async") is vv.VexactRollout


# ----------------------------------------------------------------------------------------------
# the rollout contract: generate / release / resume / update_weights
# ----------------------------------------------------------------------------------------------

def test_generate_returns_token_output_with_exact_logprobs(ckpt):
    rollout, server = make_rollout(ckpt)
    model = get("qwen3").causal_lm_class.from_pretrained(ckpt).eval()
    outs = asyncio.run(generate_all(server))
    for i, (prompt, out) in enumerate(zip(PROMPTS, outs)):
        assert isinstance(out, TokenOutput) and out.stop_reason == "completed"
        assert len(out.token_ids) == MAX_TOKENS[i] and len(out.log_probs) == len(out.token_ids)
        assert torch.equal(torch.tensor(out.log_probs), recompute(model, prompt, out.token_ids))
    no_lp = asyncio.run(server.generate(PROMPTS[0], {**PARAMS, "logprobs": False}, request_id="x"))
    assert no_lp.log_probs is None and len(no_lp.token_ids) == R  # max_tokens defaults to response_length


def test_prompt_logprobs_and_alternatives_come_in_verls_vllm_server_layout(ckpt):
    """``prompt_logprobs`` as verl's vLLM server returns it (``extra_fields["prompt_ids"]`` and
    ``["prompt_logprobs"]``, what verl's distillation teacher reads): a row per prompt token, row p
    scoring the token at p + 1, the last row zeros; with 0 that token's logprob, with 3 the three
    most probable tokens', each the actor's logprob of that token there, bitwise. ``logprobs=3``
    keeps ``log_probs`` the sampled tokens' (the alternatives are the engine's to compute)."""
    _, server = make_rollout(ckpt)
    model = get("qwen3").causal_lm_class.from_pretrained(ckpt).eval()
    seq = PROMPTS[3]
    teacher = {"max_tokens": 1, "temperature": 1.0, "detokenize": False}

    def actor(prefix: list[int], token: int) -> torch.Tensor:  # the actor's logprob of `token` after `prefix`
        return recompute(model, prefix, [token], temperature=1.0)[0]

    own = asyncio.run(server.generate(seq, {**teacher, "prompt_logprobs": 0}, request_id="k0")).extra_fields
    assert own["prompt_ids"] == [[t] for t in seq[1:]] + [[0]] and own["prompt_logprobs"][-1] == [0.0]
    assert torch.equal(torch.tensor(own["prompt_logprobs"][:-1])[:, 0],
                       torch.stack([actor(seq[:p + 1], seq[p + 1]) for p in range(len(seq) - 1)]))
    top = asyncio.run(server.generate(seq, {**teacher, "prompt_logprobs": 3}, request_id="k3")).extra_fields
    with torch.no_grad():
        logits = model(torch.tensor([seq])).logits[0, :-1]
    assert top["prompt_ids"][:-1] == logits.topk(3).indices.tolist() and top["prompt_ids"][-1] == [0, 0, 0]
    assert torch.equal(torch.tensor(top["prompt_logprobs"][:-1]),
                       torch.stack([torch.stack([actor(seq[:p + 1], t) for t in ids])
                                    for p, ids in enumerate(top["prompt_ids"][:-1])]))
    sampled = asyncio.run(server.generate(PROMPTS[1], {**PARAMS, "logprobs": 3, "max_tokens": 4}, request_id="lp3"))
    assert torch.equal(torch.tensor(sampled.log_probs), recompute(model, PROMPTS[1], sampled.token_ids))


def test_verls_distillation_teacher_scores_a_sequence_through_our_server(ckpt):
    """verl's own teacher client (`AsyncTeacherLLMServerManager`, its config built from the YAML
    fields verl reads, the default per-token loss ``k3``) asks our server for the sequence's
    ``prompt_logprobs``: a row per token, each the actor's logprob of the token after it, bitwise,
    the last row zeros. (verl's top-k losses take only vLLM and SGLang as teacher engines.)"""
    from omegaconf import OmegaConf
    from verl.experimental.teacher_loop.teacher_manager import AsyncTeacherLLMServerManager

    _, server = make_rollout(ckpt)
    model = get("qwen3").causal_lm_class.from_pretrained(ckpt).eval()

    class Client:  # what verl's LLMServerClient does with a request: the server's generate
        async def generate(self, request_id, *, prompt_ids, sampling_params, mm_processor_output=None, **kwargs):
            return await server.generate(prompt_ids, sampling_params, request_id=request_id, **kwargs)

    inference = {"_target_": "verl.workers.config.RolloutConfig", "name": vv.ROLLOUT_NAME, "tensor_model_parallel_size": 1}
    config = OmegaConf.create({"distillation": {
        "_target_": "verl.workers.config.DistillationConfig", "enabled": True, "n_gpus_per_node": 1, "nnodes": 1,
        "teacher_models": {"teacher_model": {"_target_": "verl.workers.config.DistillationTeacherModelConfig",
                                             "model_path": ckpt, "inference": inference}},
        "distillation_loss": {"_target_": "verl.workers.config.DistillationLossConfig", "loss_mode": "k3",
                              "use_policy_gradient": False}}})
    teacher = AsyncTeacherLLMServerManager(config, {"default": Client()})
    seq = PROMPTS[3]
    ids, logprobs = asyncio.run(teacher.compute_teacher_logprobs_single(sequence_ids=seq))
    assert ids.tolist() == [[t] for t in seq[1:]] + [[0]] and logprobs.shape == (len(seq), 1)
    assert torch.equal(logprobs[:-1, 0], recompute(model, seq[:1], seq[1:], temperature=1.0))
    assert logprobs[-1, 0] == 0


def test_penalties_steer_sampling_and_the_logprobs_stay_the_actors(ckpt):
    """verl's ``repetition_penalty`` / ``presence_penalty`` / ``frequency_penalty`` reach the engine's
    requests, and the returned logprobs are still the actor's recompute."""
    rollout, server = make_rollout(ckpt, full_determinism=True)
    model = get("qwen3").causal_lm_class.from_pretrained(ckpt).eval()
    seen, add = [], rollout.llm.add_request
    rollout.llm.add_request = lambda request_id, prompt, params: seen.append(params) or add(request_id, prompt, params)
    penalised = asyncio.run(generate_all(server, repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.3))
    assert len(seen) == len(PROMPTS)
    assert all((p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.5, 0.5, 0.3) for p in seen)
    for prompt, out in zip(PROMPTS, penalised):
        assert torch.equal(torch.tensor(out.log_probs), recompute(model, prompt, out.token_ids))


def test_release_resume_update_weights(ckpt):
    rollout, server = make_rollout(ckpt)
    asyncio.run(generate_all(server))
    trained = get("qwen3").causal_lm_class.from_pretrained(ckpt).eval()
    with torch.no_grad():  # "an optimizer step"
        for p in trained.parameters():
            p.add_(torch.randn_like(p) * 0.05)

    async def sync_cycle():  # what verl's hybrid worker does around every weight sync
        await rollout.release()
        with pytest.raises(RuntimeError, match="asleep"):
            await server.generate(PROMPTS[0], PARAMS, request_id="while-asleep")
        await rollout.resume(tags=["weights"])
        await rollout.update_weights(iter(trained.state_dict().items()), global_steps=7)  # a stream, not a dict
        await rollout.resume(tags=["kv_cache"])
        return await generate_all(server)

    outs = asyncio.run(sync_cycle())
    engine_params = dict(rollout.llm.model.causal_lm.named_parameters())
    for name, p in trained.named_parameters():
        assert torch.equal(engine_params[name], p), name
    for prompt, out in zip(PROMPTS, outs):
        assert out.extra_fields["global_steps"] == 7
        assert torch.equal(torch.tensor(out.log_probs), recompute(trained, prompt, out.token_ids))


def test_without_free_cache_engine_the_server_keeps_the_engine_awake(ckpt):
    """rollout.free_cache_engine=False: verl's trainer still calls the server's sleep after every
    generate (its checkpoint manager's sleep_replicas) and then syncs without waking anything, so
    sleep, release_kv_cache and resume_kv_cache must leave the engine as it is (verl's vLLM server)."""
    rollout, server = make_rollout(ckpt, free_cache_engine=False)
    trained = get("qwen3").causal_lm_class.from_pretrained(ckpt).eval()
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(torch.randn_like(p) * 0.05)

    async def two_steps():  # verl's naive sync, then generate, then sleep_replicas; twice
        outs = None
        for _ in range(2):
            await server.release_kv_cache()
            await rollout.update_weights(iter(trained.state_dict().items()))
            await server.resume_kv_cache()
            outs = await generate_all(server)
            await server.sleep()
        return outs

    outs = asyncio.run(two_steps())
    assert rollout.llm.runner.kv_caches, "the KV cache was released"
    for prompt, out in zip(PROMPTS, outs):
        assert torch.equal(torch.tensor(out.log_probs), recompute(trained, prompt, out.token_ids))


async def _async_stream(pairs):  # a checkpoint engine's receiver yields asynchronously
    for pair in pairs:
        await asyncio.sleep(0)
        yield pair


@pytest.mark.parametrize("name, asynchronous", [("qwen3_moe", False), ("deepseek_v3", True)])
def test_update_weights_refuses_verls_per_expert_stream(tmp_path_factory, name, asynchronous):
    """verl streams MoE experts one tensor per expert (its unfuse_moe_params) and the trainer's
    buffers with its parameters (state_dict); the engine gets the experts fused, the buffers copied."""
    path = save_tiny(tmp_path_factory, name)
    rollout, _ = make_rollout(path)
    torch.manual_seed(1)
    trained = get(name).causal_lm_class(get(name).tiny_config(initializer_range=0.5)).eval()
    for n, b in trained.named_buffers():
        if n in trained.state_dict():  # persistent buffers (DeepSeek's e_score_correction_bias): not all zero
            b.copy_(torch.randn_like(b))
    stream = list(unfuse_moe_params(trained.state_dict().items(), trained.config.model_type))
    assert any(".experts.0.gate_proj.weight" in n for n, _ in stream)  # the stream really is per expert
    asyncio.run(rollout.update_weights(_async_stream(stream) if asynchronous else iter(stream)))
    engine = rollout.llm.model.causal_lm
    engine_state = dict(engine.named_parameters()) | dict(engine.named_buffers())
    for n, t in list(trained.named_parameters()) + list(trained.named_buffers()):
        assert torch.equal(engine_state[n], t), n
    cut = [pair for pair in stream if not pair[0].endswith(".experts.3.down_proj.weight")]
    with pytest.raises(ValueError, match="experts missing"):
        asyncio.run(rollout.update_weights(iter(cut)))


def test_stop_strings_cut_requests_with_the_checkpoint_tokenizer(ckpt, tmp_path):
    """verl's ``stop`` (vLLM's stop strings): with the checkpoint's tokenizer the request ends at
    the token completing the string, its tokens and logprobs those of the request without it cut
    there; ``structured_outputs`` keeps each output inside its regex, the logprobs the actor's, and
    ``bad_words`` keeps a word out;
    without a tokenizer (the ``ckpt`` folder) the request fails alone, naming it."""
    import shutil

    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder = tmp_path / "with_tokenizer"
    shutil.copytree(ckpt, folder)
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(512)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0").save_pretrained(folder)
    _, server = make_rollout(str(folder))
    greedy = {**PARAMS, "temperature": 0.0, "max_tokens": 8}
    full = asyncio.run(server.generate(PROMPTS[0], greedy, request_id="full"))
    words = [f"w{t}" for t in full.token_ids]
    stop = words[2]
    first = next(i for i in range(len(words)) if stop in " ".join(words[:i + 1]))
    cut = asyncio.run(server.generate(PROMPTS[0], {**greedy, "stop": [stop]}, request_id="cut"))
    assert (cut.token_ids, cut.log_probs) == (full.token_ids[:first + 1], full.log_probs[:first + 1])
    none = asyncio.run(server.generate(PROMPTS[0], {**greedy, "stop": None}, request_id="none"))
    assert none.token_ids == full.token_ids
    # vLLM's structured_outputs, with the same tokenizer: only "w1..." words (1, the EOS, ends a complete output)
    model = get("qwen3").causal_lm_class.from_pretrained(ckpt).eval()
    for i, prompt in enumerate(PROMPTS):
        done = asyncio.run(server.generate(prompt, {**PARAMS, "structured_outputs": {"regex": "(w1[0-9]*)+"}},
                                           request_id=f"regex-{i}"))
        assert done.token_ids and all(f"w{t}".startswith("w1") for t in done.token_ids), done.token_ids
        assert torch.equal(torch.tensor(done.log_probs), recompute(model, prompt, done.token_ids))
    banned = asyncio.run(server.generate(PROMPTS[0], {**greedy, "bad_words": [words[0]]}, request_id="banned"))
    assert full.token_ids[0] not in banned.token_ids  # vLLM's bad_words: the greedy first word never comes
    _, bare = make_rollout(ckpt)

    async def together():  # one batch: the request with stop strings fails alone
        return await asyncio.gather(bare.generate(PROMPTS[0], {**PARAMS, "stop": ["w1"]}, request_id="stop"),
                                    bare.generate(PROMPTS[1], PARAMS, request_id="plain"), return_exceptions=True)

    failed, served = asyncio.run(together())
    assert isinstance(failed, ValueError) and "SamplingParams.stop (stop strings) needs a tokenizer" in str(failed)
    assert isinstance(served, TokenOutput) and served.token_ids


def test_bad_input_is_a_value_error_naming_it(ckpt):
    with pytest.raises(ValueError, match="tensor_model_parallel_size=2"):
        make_rollout(ckpt, tensor_model_parallel_size=2)
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['kv_bytes'\]"):
        make_rollout(ckpt, engine={"kv_bytes": 1})
    rollout, server = make_rollout(ckpt)
    for params, match in [({"repetition_penalty": 0.0}, r"repetition_penalty=0\.0 must be > 0"),
                          ({"presence_penalty": 3.0}, r"presence_penalty=3\.0 is outside"), ({"n": 2}, r"\['n'\]=2"),
                          ({"logprobs": -1}, "logprobs"), ({"prompt_logprobs": -1}, "prompt_logprobs"),
                          ({"stop": [3]}, r"stop\[0\]=3"), ({"best_of": 2}, "best_of"), ({"temperature": -1.0}, "temperature"),
                          ({"min_p": 1.5}, r"min_p=1\.5 is outside \[0, 1\]")]:
        with pytest.raises(ValueError, match=match):
            asyncio.run(server.generate(PROMPTS[0], {**PARAMS, **params}, request_id="bad"))
    with pytest.raises(ValueError, match="max_model_len=16"):
        asyncio.run(server.generate(list(range(2, 18)), PARAMS, request_id="long"))
    with pytest.raises(ValueError, match="wire_format"):
        asyncio.run(rollout.update_weights(iter([]), wire_format="delta_flush"))
    with pytest.raises(ValueError, match="peft_type='None'; only LoRA"):
        asyncio.run(rollout.update_weights(iter([]), peft_config={"r": 8}))
    with pytest.raises(ValueError, match=r"modules_to_save=\['lm_head'\] .*lora.merge=True"):
        asyncio.run(rollout.update_weights(iter([]), peft_config={"peft_type": "LORA", "r": 8,
                                                                  "modules_to_save": ["lm_head"]}))
    assert not any("lora_" in n for n, _ in rollout.llm.model.causal_lm.named_parameters())  # nothing injected
    outs = asyncio.run(generate_all(server, [PROMPTS[0], [5, 100_000], PROMPTS[2]], return_exceptions=True))
    assert isinstance(outs[1], ValueError) and "100000" in str(outs[1])  # fails alone, not its batch
    assert isinstance(outs[0], TokenOutput) and isinstance(outs[2], TokenOutput)
    assert asyncio.run(server.generate(PROMPTS[0], {**PARAMS, "min_p": 0.1}, request_id="min_p")).token_ids
    out = asyncio.run(server.generate(PROMPTS[3], {**PARAMS, "max_tokens": 100}, request_id="clamped"))
    assert len(out.token_ids) == 16 - len(PROMPTS[3])  # clamped to the room left in max_model_len


# ----------------------------------------------------------------------------------------------
# the replica under Ray: verl's own worker hosts the engine, our server batches into it
# ----------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_replica_under_ray(ckpt, monkeypatch):
    """verl's ``RolloutReplica.init_colocated``: a verl ``CheckpointEngineWorker`` (which builds
    its rollout by name from verl's registry, in a Ray process that registered us through
    ``VERL_USE_EXTERNAL_MODULES``) hosts the engine; `VexactReplica` starts the server actor;
    requests go through the server handle as verl's ``LLMServerClient`` sends them."""
    ray = pytest.importorskip("ray")
    from verl.single_controller.ray import RayResourcePool

    class CPUReplica(vv.VexactReplica):  # verl's colocated workers ask for a GPU unless told otherwise
        def rollout_worker_use_gpu(self):
            return False

    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # a throwaway local cluster: no token file in ~/.ray
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"VERL_USE_EXTERNAL_MODULES": "vexact_models.integrations.verl"}})
    try:
        config = rollout_config(engine={"sleep_level": 1})
        replica = CPUReplica(replica_rank=0, config=config, model_config=model_config(ckpt), gpus_per_node=1)

        async def run():
            await replica.init_colocated(RayResourcePool(process_on_nodes=[1], use_gpu=False, max_colocate_count=1))
            server = replica.server_handle
            first = await asyncio.gather(*[
                server.generate.remote(prompt_ids=p, sampling_params={**PARAMS, "max_tokens": MAX_TOKENS[i]},
                                       request_id=f"req-{i}") for i, p in enumerate(PROMPTS)])
            await replica.sleep()
            with pytest.raises(ray.exceptions.RayTaskError, match="asleep"):
                await server.generate.remote(prompt_ids=PROMPTS[0], sampling_params=PARAMS, request_id="asleep")
            await replica.wake_up()
            again = await server.generate.remote(prompt_ids=PROMPTS[0], sampling_params=PARAMS, request_id="woken")
            return first, again

        first, again = asyncio.run(run())
        assert replica.server_address == "vexact://vexact_server_0"
    finally:
        ray.shutdown()
    model = get("qwen3").causal_lm_class.from_pretrained(ckpt).eval()
    for prompt, out in zip(PROMPTS + [PROMPTS[0]], first + [again]):
        assert isinstance(out, TokenOutput)
        assert torch.equal(torch.tensor(out.log_probs), recompute(model, prompt, out.token_ids))
