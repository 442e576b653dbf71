"""verl integration (``vexact_models.integrations.verl``) against verl's own classes.

Runs where verl imports (``.ci/verl`` builds that venv: verl 0.9.1 pins transformers < 5.11);
skipped elsewhere. verl's FSDP engine needs an accelerator platform: the tests give it a CPU one
through verl's platform extension point (`set_platform`), and run the engine's own input
preparation, forward and output unpacking on the unsharded module (FSDP wrapping itself needs a
GPU; ``docs/verl.md`` says how to run the full trainer there).
"""

import asyncio
import socket

import pytest
import torch

vv = pytest.importorskip("vexact_models.integrations.verl", reason="verl (and ray) not importable here",
                         exc_type=ImportError)

import torch.distributed as dist  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402
from verl import DataProto  # noqa: E402
from verl.trainer.config import CheckpointConfig  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.utils.debug.metrics import calculate_debug_metrics  # noqa: E402
from verl.utils.model import compute_position_id_with_mask  # noqa: E402
from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig, RolloutConfig  # noqa: E402
from verl.workers.engine.fsdp.utils import unfuse_moe_params  # noqa: E402
from verl.workers.rollout import base as verl_rollout_base  # noqa: E402
from verl.workers.rollout.base import BaseRollout, get_rollout_class  # noqa: E402
from verl.workers.rollout.replica import RolloutReplica, RolloutReplicaRegistry, TokenOutput  # noqa: E402
from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding  # noqa: E402

import vexact_models  # noqa: E402
from vexact_models.registry import get  # noqa: E402

P, R, TEMP = 8, 8, 0.9  # prompt / response budget, sampling temperature (not 1: it must reach both sides)
PROMPTS = [[3, 4, 5], [7, 8, 9, 10, 11], [12], [20, 21, 22, 23, 24, 25, 26, 27]]
MAX_TOKENS = [2, 4, 6, 8]  # the last fills max_model_len = P + R exactly
PARAMS = {"temperature": TEMP, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True}


def _save(tmp_path_factory, name: str, **overrides) -> str:
    arch = get(name)
    torch.manual_seed(0)
    path = str(tmp_path_factory.mktemp(name))
    # initializer_range=0.5: peaked distributions, so sampled tokens depend on the weights
    arch.causal_lm_class(arch.tiny_config(initializer_range=0.5, **overrides)).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return _save(tmp_path_factory, "qwen3")


def rollout_config(**overrides) -> RolloutConfig:
    engine = {"kv_cache_bytes": 1 << 20, "block_size": 4, "device": "cpu", "max_num_seqs": 8,
              "max_num_batched_tokens": 16}  # small budgets: chunked prefill and several decode steps
    engine.update(overrides.pop("engine", {}))
    fields = dict(name=vv.ROLLOUT_NAME, tensor_model_parallel_size=1, prompt_length=P, response_length=R,
                  dtype="float32", temperature=TEMP, ignore_eos=True, engine_kwargs={"vexact": engine})
    fields.update(overrides)
    return RolloutConfig(**fields)


def make_rollout(path: str, **overrides) -> tuple[BaseRollout, "vv.VexactServer"]:
    """verl's way: the class named by rollout.name from verl's registry, built with verl's configs."""
    config = rollout_config(**overrides)
    rollout = get_rollout_class(config.name, config.mode)(config=config, model_config=model_config(path),
                                                          device_mesh=None, replica_rank=0)
    return rollout, vv.VexactServer(config, rollout=rollout)


def model_config(path: str, **kwargs) -> HFModelConfig:
    return HFModelConfig(path=path, load_tokenizer=False, **kwargs)


async def generate_all(server, prompts=PROMPTS, return_exceptions=False, **params) -> list:
    """Every prompt at once, as verl's agent loops send them (one request each)."""
    return await asyncio.gather(*[server.generate(p, {**PARAMS, "max_tokens": MAX_TOKENS[i], **params},
                                                  request_id=f"req-{i}") for i, p in enumerate(prompts)],
                                return_exceptions=return_exceptions)


def recompute(model, prompt, tokens, temperature=TEMP) -> torch.Tensor:
    with torch.no_grad():
        return model.token_logprobs(torch.tensor([prompt + tokens]), temperature=temperature)[0, len(prompt):]


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


def test_batched_requests_equal_one_at_a_time(ckpt):
    """full_determinism: each request's seed comes from its id, so batching changes nothing."""
    _, server = make_rollout(ckpt, full_determinism=True)
    together = asyncio.run(generate_all(server))
    _, alone_server = make_rollout(ckpt, full_determinism=True, engine={"batch_window_ms": 0})
    for i, prompt in enumerate(PROMPTS):  # each alone, under its own request id
        single = asyncio.run(alone_server.generate(prompt, {**PARAMS, "max_tokens": MAX_TOKENS[i]}, request_id=f"req-{i}"))
        assert single.token_ids == together[i].token_ids and single.log_probs == together[i].log_probs
    others = [asyncio.run(alone_server.generate(PROMPTS[3], {**PARAMS, "max_tokens": 8}, request_id=f"other-{k}"))
              for k in range(3)]
    assert any(o.token_ids != together[3].token_ids for o in others)  # the id does pick the sample


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


async def _async_stream(pairs):  # a checkpoint engine's receiver yields asynchronously
    for pair in pairs:
        await asyncio.sleep(0)
        yield pair


def test_abort_holds_requests_until_resume(ckpt):
    """verl's partial-rollout protocol around a weight sync: abort_all_requests holds new work
    (or answers it ``aborted`` with reject_request) until resume_generation."""
    _, server = make_rollout(ckpt)

    async def run():
        await server.abort_all_requests()
        held = asyncio.create_task(server.generate(PROMPTS[0], PARAMS, request_id="held"))
        await asyncio.sleep(0.2)
        assert not held.done()  # the gate is closed
        await server.resume_generation()
        done = await held
        await server.abort_all_requests(reject_request=True)
        rejected = await server.generate(PROMPTS[0], PARAMS, request_id="rejected")
        await server.resume_generation()
        return done, rejected, await server.generate(PROMPTS[0], PARAMS, request_id="after")

    done, rejected, after = asyncio.run(run())
    assert done.stop_reason == "completed" and len(done.token_ids) == R
    assert rejected.stop_reason == "aborted" and rejected.token_ids == []
    assert after.stop_reason == "completed"


@pytest.mark.parametrize("name, asynchronous", [("qwen3_moe", False), ("deepseek_v3", True)])
def test_update_weights_refuses_verls_per_expert_stream(tmp_path_factory, name, asynchronous):
    """verl streams MoE experts one tensor per expert (its unfuse_moe_params) and the trainer's
    buffers with its parameters (state_dict); the engine gets the experts fused, the buffers copied."""
    path = _save(tmp_path_factory, name)
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


def test_bad_input_is_a_value_error_naming_it(ckpt):
    with pytest.raises(ValueError, match="tensor_model_parallel_size=2"):
        make_rollout(ckpt, tensor_model_parallel_size=2)
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['kv_bytes'\]"):
        make_rollout(ckpt, engine={"kv_bytes": 1})
    rollout, server = make_rollout(ckpt)
    for params, match in [({"repetition_penalty": 1.2}, "repetition_penalty"), ({"logprobs": 5}, "logprobs"),
                          ({"stop": ["</s>"]}, "stop"), ({"best_of": 2}, "best_of"), ({"temperature": -1.0}, "temperature")]:
        with pytest.raises(ValueError, match=match):
            asyncio.run(server.generate(PROMPTS[0], {**PARAMS, **params}, request_id="bad"))
    with pytest.raises(ValueError, match="max_model_len=16"):
        asyncio.run(server.generate(list(range(2, 18)), PARAMS, request_id="long"))
    with pytest.raises(ValueError, match="wire_format"):
        asyncio.run(rollout.update_weights(iter([]), wire_format="delta_flush"))
    with pytest.raises(ValueError, match="lora.merge"):
        asyncio.run(rollout.update_weights(iter([]), peft_config={"r": 8}))
    outs = asyncio.run(generate_all(server, [PROMPTS[0], [5, 100_000], PROMPTS[2]], return_exceptions=True))
    assert isinstance(outs[1], ValueError) and "100000" in str(outs[1])  # fails alone, not its batch
    assert isinstance(outs[0], TokenOutput) and isinstance(outs[2], TokenOutput)
    out = asyncio.run(server.generate(PROMPTS[3], {**PARAMS, "max_tokens": 100}, request_id="clamped"))
    assert len(out.token_ids) == 16 - len(PROMPTS[3])  # clamped to the room left in max_model_len


# ----------------------------------------------------------------------------------------------
# the actor side: verl's own log-prob computation and metric
# ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def verl_cpu():
    """verl's engine on CPU: a CPU platform through verl's platform extension point, and a
    one-process gloo group (verl's engine all-reduces token counts)."""
    from verl.plugin.platform import platform_manager
    from verl.plugin.platform.platform_cuda import PlatformCUDA

    class CPUPlatform(PlatformCUDA):
        device_name = property(lambda self: "cpu")
        device_module = property(lambda self: torch.cpu)

        def is_available(self):
            return True

        def current_device(self):
            return "cpu"

        def synchronize(self, device_index=None):
            pass

        def empty_cache(self):
            pass

        def communication_backend_name(self):
            return "gloo"

    saved = platform_manager._current_platform
    platform_manager.set_platform(CPUPlatform())
    own_group = not dist.is_initialized()
    if own_group:
        with socket.socket() as s:  # a free port: other test runs may share the machine
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    if own_group:
        dist.destroy_process_group()
    platform_manager._current_platform = saved


def verl_engine(path: str, fused: bool, remove_padding: bool = True):
    """verl's FSDP actor engine, its module built by verl's own loader (AutoModelForCausalLM and
    verl's monkey patches), left unsharded on CPU."""
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    # impl_backend="torch": verl's YAML default, under which verl replaces a model's forward with its own
    # fused-linear one (for every class but ours, once installed)
    mc = model_config(path, use_remove_padding=remove_padding, use_fused_kernels=fused,
                      fused_kernel_options={"impl_backend": "torch"}, enable_gradient_checkpointing=False,
                      override_config={"attn_implementation": "sdpa"})
    engine = FSDPEngineWithLMHead(mc, FSDPEngineConfig(forward_only=True, use_torch_compile=False, model_dtype="fp32"),
                                  FSDPOptimizerConfig(lr=1e-5), CheckpointConfig())
    engine.module = engine._build_module()
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
def test_actor_logprobs_equal_rollout_and_verls_metric_is_zero(ckpt, verl_cpu, remove_padding):
    _, server = make_rollout(ckpt)
    tensors = rollout_batch(asyncio.run(generate_all(server)))
    engine = verl_engine(ckpt, fused=True, remove_padding=remove_padding)
    assert type(engine.module) is get("qwen3").causal_lm_class
    old = actor_old_log_probs(engine, tensors, fused=True, remove_padding=remove_padding)
    assert torch.equal(old * tensors["response_mask"], tensors["rollout_log_probs"])
    metrics = diff_metrics(tensors, old)
    assert metrics["training/rollout_probs_diff_valid"] == 1
    assert metrics["training/rollout_probs_diff_max"] == 0.0


@pytest.mark.parametrize("variant", ["stock transformers class", "our class, verl's fused path"])
def test_verls_metric_is_nonzero_without_the_hook(ckpt, verl_cpu, variant):
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
