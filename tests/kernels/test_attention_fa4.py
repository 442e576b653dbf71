"""FlashAttention-4 as the attention forward (`VEXACT_ATTENTION_FORWARD=fa4`) and backward, on a
Hopper GPU with the optional flash-attn-4 package: training, chunked prefill and decode rows
bitwise equal through our API, the switch live (its bits are not our kernel's), gradients
against float64, and an engine's rollout equal to the training recompute under it."""

import pytest
import torch

from vexact_models.kernels import PagedLayout, attention, attention_packed, use_attention_forward
from vexact_models.kernels.attention_backward_choice import use_attention_backward
from vexact_models.kernels.attention_fa4 import fa4_unavailable_reason


def _fa4_missing() -> str | None:
    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    x = torch.empty(1, 1, 128, device="cuda", dtype=torch.bfloat16)
    return fa4_unavailable_reason(x, x, x)


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_fa4_missing() is not None, reason=f"FA4: {_fa4_missing()}")]


def _paged(k, v, lens, page):
    """The sequences' K/V in shuffled pages: (k_cache, v_cache [pages, page, H, D], table int32)."""
    counts = [-(-n // page) for n in lens]
    order = torch.randperm(sum(counts), device=k.device).int()
    k_cache = torch.randn(sum(counts), page, *k.shape[1:], device=k.device, dtype=k.dtype)
    v_cache = torch.randn(sum(counts), page, *v.shape[1:], device=v.device, dtype=v.dtype)
    table = torch.zeros(len(lens), max(counts), dtype=torch.int32, device=k.device)
    start = first = 0
    for s, n in enumerate(lens):
        table[s, :counts[s]] = order[first:first + counts[s]]
        slots = (table[s, :counts[s]].long()[:, None] * page + torch.arange(page, device=k.device)).flatten()[:n]
        k_cache.view(-1, *k.shape[1:])[slots] = k[start:start + n]
        v_cache.view(-1, *v.shape[1:])[slots] = v[start:start + n]
        start, first = start + n, first + counts[s]
    return k_cache, v_cache, table


def _by_paths(q, k, v, lens, chunk, page):
    """(packed training rows, chunked prefill rows, decode rows) through our public API."""
    dev = q.device
    starts = [sum(lens[:i]) for i in range(len(lens))]
    cu = torch.tensor(starts + [sum(lens)], dtype=torch.int32, device=dev)
    packed = attention_packed(q, k, v, cu, max(lens))
    k_cache, v_cache, table = _paged(k, v, lens, page)
    prefill, decode = torch.empty_like(packed), torch.empty_like(packed)
    for size, out in ((chunk, prefill), (1, decode)):
        for c0 in range(0, max(lens), size):
            live = [s for s, n in enumerate(lens) if n > c0]
            sizes = [min(size, lens[s] - c0) for s in live]
            rows = torch.cat([torch.arange(starts[s] + c0, starts[s] + c0 + m, device=dev) for s, m in zip(live, sizes)])
            cu_q = torch.tensor([0] + torch.tensor(sizes).cumsum(0).tolist(), dtype=torch.int32, device=dev)
            seen = torch.tensor([c0 + m for m in sizes], dtype=torch.int32, device=dev)
            out[rows] = attention(q[rows], k_cache, v_cache, PagedLayout(cu_q, seen, table[live].contiguous(), page,
                                                                         max(sizes)))
    return packed, prefill, decode


@pytest.mark.parametrize("heads,dims,page", [((4, 2), (128, 128), 16), ((8, 2), (128, 128), 128),
                                             ((4, 4), (192, 128), 16)])
def test_fa4_rows_are_bitwise_equal_across_training_prefill_and_decode(heads, dims, page):
    torch.manual_seed(0)
    lens = [300, 129, 1, 257]
    q = torch.randn(sum(lens), heads[0], dims[0], device="cuda").bfloat16()
    k = torch.randn(sum(lens), heads[1], dims[0], device="cuda").bfloat16()
    v = torch.randn(sum(lens), heads[1], dims[1], device="cuda").bfloat16()
    with use_attention_forward("fa4"):
        packed, prefill, decode = _by_paths(q, k, v, lens, chunk=50, page=page)
    assert torch.equal(prefill, packed) and torch.equal(decode, packed)
    ours = _by_paths(q, k, v, lens, chunk=50, page=page)[0]
    assert not torch.equal(ours, packed)  # the switch is live: FA4's bits are not our kernel's
    torch.testing.assert_close(packed.float(), ours.float(), atol=2e-2, rtol=2e-2)


def _reference_grads(q, k, v, cu, go, scale):
    """float64 autograd of causal attention per sequence (GQA by repeating K/V heads)."""
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    outs = []
    rep = q.shape[1] // k.shape[1]
    for s in range(len(cu) - 1):
        a, b = int(cu[s]), int(cu[s + 1])
        qs, ks, vs = q64[a:b].transpose(0, 1), k64[a:b].repeat_interleave(rep, 1).transpose(0, 1), \
            v64[a:b].repeat_interleave(rep, 1).transpose(0, 1)
        scores = (qs @ ks.transpose(1, 2)) * scale
        mask = torch.ones(b - a, b - a, dtype=torch.bool, device=q.device).triu(1)
        outs.append((scores.masked_fill(mask, float("-inf")).softmax(-1) @ vs).transpose(0, 1))
    torch.cat(outs).backward(go.double())
    return q64.grad, k64.grad, v64.grad


@pytest.mark.parametrize("forward", ["fa4", "triton"])
def test_fa4_backward_matches_float64_on_either_forward(forward):
    torch.manual_seed(1)
    lens = [200, 77]
    cu = torch.tensor([0, 200, 277], dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(277, h, 128, device="cuda").bfloat16().requires_grad_() for h in (4, 2, 2))
    go = torch.randn(277, 4, 128, device="cuda").bfloat16()
    with use_attention_forward(forward), use_attention_backward("fa4"):
        out = attention_packed(q, k, v, cu, max(lens))
        grads = torch.autograd.grad(out, (q, k, v), go)
    for got, want in zip(grads, _reference_grads(q, k, v, cu, go, 128 ** -0.5)):
        torch.testing.assert_close(got.double(), want, atol=3e-2, rtol=3e-2)


def test_an_engine_rolls_out_the_training_logprobs_under_fa4():
    """A whole rollout (CUDA graphs of decode and mixed steps, chunked prefill) equals the training
    recompute bitwise under FA4; switching the forward makes the engine capture its graphs again,
    and the logprobs then differ (the switch reaches the engine)."""
    import vexact_models.qwen3 as qwen3
    from vexact_models.runtime import LLM, SamplingParams

    torch.manual_seed(0)
    config = qwen3.tiny_config(initializer_range=0.5, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                               head_dim=128)
    model = qwen3.Qwen3ForCausalLM(config).to("cuda", torch.bfloat16).eval()
    llm = LLM(model, block_size=16, max_num_seqs=4, max_num_batched_tokens=64, kv_cache_bytes=1 << 25)
    prompts = [[(7 * i + j) % 500 + 2 for j in range(20 + 13 * i)] for i in range(6)]
    params = SamplingParams(temperature=0.8, max_tokens=24, seed=5, ignore_eos=True)

    def rollout():
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]

    with use_attention_forward("fa4"):
        got = rollout()
        graphs = llm.runner.graphs
        assert graphs.num_mixed > 0
        for prompt, (tokens, logprobs) in zip(prompts, got):
            with torch.no_grad():
                lp = model.token_logprobs(torch.tensor([prompt + tokens], device="cuda"), temperature=0.8)
            assert torch.equal(lp[0, len(prompt):].cpu(), torch.tensor(logprobs))
    ours = rollout()
    assert llm.runner.graphs is not graphs  # captured again under our kernel
    assert [lp for _, lp in ours] != [lp for _, lp in got]
