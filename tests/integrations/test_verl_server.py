"""verl integration, the rollout's server (``VexactServer``) against verl's own classes: each
request an online request of the engine (joining the running batch, the same tokens as alone),
and verl's abort protocol (held and rejected requests, running ones stopped with their partial
output). Runs where verl imports (``.ci/verl``); skipped elsewhere. The rest of the rollout side is
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
from verl_support import MAX_TOKENS, PARAMS, PROMPTS, R, generate_all, make_rollout, recompute, save_tiny  # noqa: E402

from vexact_models.registry import get  # noqa: E402


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_tiny(tmp_path_factory, "qwen3")


def test_batched_requests_equal_one_at_a_time(ckpt):
    """full_determinism: each request's seed comes from its id, so batching changes nothing."""
    _, server = make_rollout(ckpt, full_determinism=True)
    together = asyncio.run(generate_all(server))
    _, alone_server = make_rollout(ckpt, full_determinism=True)
    for i, prompt in enumerate(PROMPTS):  # each alone, under its own request id
        single = asyncio.run(alone_server.generate(prompt, {**PARAMS, "max_tokens": MAX_TOKENS[i]}, request_id=f"req-{i}"))
        assert single.token_ids == together[i].token_ids and single.log_probs == together[i].log_probs
    others = [asyncio.run(alone_server.generate(PROMPTS[3], {**PARAMS, "max_tokens": 8}, request_id=f"other-{k}"))
              for k in range(3)]
    assert any(o.token_ids != together[3].token_ids for o in others)  # the id does pick the sample


def test_a_request_joins_the_running_ones(ckpt):
    """A short request sent while a long one runs comes back first: it joined the engine's running
    batch instead of waiting for it (and equals the same request sent alone)."""
    rollout, server = make_rollout(ckpt, full_determinism=True, response_length=400)
    finished = []

    async def ask(name: str, max_tokens: int, delay: float):
        await asyncio.sleep(delay)
        out = await server.generate(PROMPTS[0], {**PARAMS, "max_tokens": max_tokens}, request_id=name)
        finished.append(name)
        return out

    async def run():
        return await asyncio.gather(ask("long", 400, 0.0), ask("short", 2, 0.3))

    long, short = asyncio.run(run())
    assert finished == ["short", "long"] and len(long.token_ids) == 400 and len(short.token_ids) == 2
    alone = asyncio.run(server.generate(PROMPTS[0], {**PARAMS, "max_tokens": 2}, request_id="short"))
    assert alone.token_ids == short.token_ids and alone.log_probs == short.log_probs
    assert not rollout.llm.has_unfinished_requests()


def test_abort_stops_running_requests_with_their_partial_output(ckpt):
    """verl's partial rollout: abort_all_requests stops a running request now; it comes back
    ``aborted`` with the tokens and logprobs it had (the actor's recompute of them, bitwise);
    abort_request stops one by id; after resume_generation requests run to the end again."""
    rollout, server = make_rollout(ckpt, full_determinism=True, response_length=400)
    model = get("qwen3").causal_lm_class.from_pretrained(ckpt).eval()

    async def run():
        running = asyncio.create_task(server.generate(PROMPTS[1], {**PARAMS, "max_tokens": 400}, request_id="long"))
        while not rollout.llm.has_unfinished_requests() or not any(
                s.num_output_tokens > 3 for r in rollout.llm._online.values() for s in r.seqs):
            await asyncio.sleep(0.01)
        report = await server.abort_all_requests()
        stopped = await running
        await server.resume_generation()
        one = asyncio.create_task(server.generate(PROMPTS[0], {**PARAMS, "max_tokens": 400}, request_id="one"))
        while not rollout.llm.has_unfinished_requests():
            await asyncio.sleep(0.01)
        assert (await server.abort_request("one"))["aborted"]
        after = await server.generate(PROMPTS[0], {**PARAMS, "max_tokens": 4}, request_id="after")
        return report, stopped, await one, after

    report, stopped, one, after = asyncio.run(run())
    assert report == {"aborted_count": 1, "request_ids": ["long"]}
    assert stopped.stop_reason == "aborted" and 3 < len(stopped.token_ids) < 400
    assert torch.equal(torch.tensor(stopped.log_probs), recompute(model, PROMPTS[1], stopped.token_ids))
    assert one.stop_reason == "aborted" and len(one.token_ids) < 400
    assert after.stop_reason == "completed" and len(after.token_ids) == 4
    assert not rollout.llm.has_unfinished_requests()


def test_the_removed_batch_window_option_says_why(ckpt):
    with pytest.raises(ValueError, match="batch_window_ms=20.*running batch"):
        make_rollout(ckpt, engine={"batch_window_ms": 20})


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
