"""What the verl integration tests (`test_verl_rollout.py`, `test_verl_actor.py`) share: tiny
checkpoints, verl's rollout configs built the way verl builds them, the requests both sides score,
and the recompute that checks a rollout's logprobs. Imports verl: the tests import it after their
`pytest.importorskip` of the integration (``.ci/verl`` builds the venv where it imports)."""

import asyncio
import socket

import pytest
import torch
import torch.distributed as dist
from verl.workers.config import HFModelConfig, RolloutConfig
from verl.workers.rollout.base import BaseRollout, get_rollout_class

import vexact_models.integrations.verl as vv
from vexact_models.registry import get

P, R, TEMP = 8, 8, 0.9  # prompt / response budget, sampling temperature (not 1: it must reach both sides)
PROMPTS = [[3, 4, 5], [7, 8, 9, 10, 11], [12], [20, 21, 22, 23, 24, 25, 26, 27]]
MAX_TOKENS = [2, 4, 6, 8]  # the last fills max_model_len = P + R exactly
PARAMS = {"temperature": TEMP, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True}


def save_tiny(tmp_path_factory, name: str, **overrides) -> str:
    arch = get(name)
    torch.manual_seed(0)
    path = str(tmp_path_factory.mktemp(name))
    # initializer_range=0.5: peaked distributions, so sampled tokens depend on the weights
    arch.causal_lm_class(arch.tiny_config(initializer_range=0.5, **overrides)).save_pretrained(path)
    return path


def rollout_config(**overrides) -> RolloutConfig:
    engine = {"kv_cache_bytes": 1 << 20, "block_size": 4, "device": "cpu", "max_num_seqs": 8,
              "max_num_batched_tokens": 16}  # small budgets: chunked prefill and several decode steps
    engine.update(overrides.pop("engine", {}))
    fields = dict(name=vv.ROLLOUT_NAME, tensor_model_parallel_size=1, prompt_length=P, response_length=R,
                  dtype="float32", temperature=TEMP, ignore_eos=True, engine_kwargs={"vexact": engine})
    fields.update(overrides)
    return RolloutConfig(**fields)


def make_rollout(path: str, **overrides) -> tuple[BaseRollout, vv.VexactServer]:
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
