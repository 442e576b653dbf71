"""`fused_moe`'s GPT-OSS form (gate/up and down biases, the clamped SwiGLU, interleaved gate/up
rows read from HF's transposed ``[E, H, 2I]`` / ``[E, I, H]`` parameters) by the Triton kernels
against the CPU reference and the plain-torch oracle, forward and backward; and each pair's rows
the same under every tile config. Run as `check_triton_kernels.py` is (the interpreter in CI, or
a GPU)."""

import os

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if not (INTERPRET and os.environ.get("VEXACT_BACKEND") == "triton") and not torch.cuda.is_available():
    pytest.skip("needs a GPU, or TRITON_INTERPRET=1 VEXACT_BACKEND=triton", allow_module_level=True)
DEVICE = "cpu" if INTERPRET else "cuda"

from vexact_models.kernels import use_backend  # noqa: E402
from vexact_models.kernels.moe import fused_moe, gate_up_act, moe_align  # noqa: E402
from vexact_models.kernels.moe_activation import ExpertForm, SwigluClamp  # noqa: E402
from vexact_models.kernels.moe_backward import moe_math  # noqa: E402
from vexact_models.kernels.moe_config import DECODE, FEW_ROWS, LARGE, SMALL  # noqa: E402
from vexact_models.kernels.moe_grouped_gemm import grouped_gemm  # noqa: E402
from vexact_models.kernels.moe_routing import softmax_topk  # noqa: E402


def close(a, b, tol):
    a, b = a.double(), b.double()
    err = float((a - b).norm() / b.norm().clamp_min(1e-30))
    assert err < tol, err


def gpt_oss_experts(experts, hidden, inter, dtype, scale=3.0):
    """HF GPT-OSS parameters: gate_up ``[E, H, 2I]`` (gate/up interleaved), its bias, down
    ``[E, I, H]``, its bias; products large enough that the clamp at 7 acts."""
    gate_up = (torch.randn(experts, hidden, 2 * inter, device=DEVICE) * scale / hidden ** 0.5).to(dtype)
    down = (torch.randn(experts, inter, hidden, device=DEVICE) / inter ** 0.5).to(dtype)
    return gate_up, torch.randn(experts, 2 * inter, device=DEVICE).to(dtype), down, \
        torch.randn(experts, hidden, device=DEVICE).to(dtype)


def call(x, gate_up, gate_up_bias, down, down_bias, w, ids):
    return fused_moe(x, gate_up.transpose(1, 2), down.transpose(1, 2), w, ids, gate_up_bias=gate_up_bias,
                     down_bias=down_bias, clamp=SwigluClamp(), interleaved=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [12, 48])  # 16- and 64-row tiles (`pick_config` at 8 experts, top-4)
def test_gpt_oss_form_forward_matches_reference(dtype, tokens):
    experts, hidden, inter = 8, 64, 48
    x = torch.randn(tokens, hidden, device=DEVICE).to(dtype)
    params = gpt_oss_experts(experts, hidden, inter, dtype)
    logits = torch.randn(tokens, experts, device=DEVICE)
    logits[:tokens // 2, 3] += 10  # one expert takes half the rows, some none
    w, ids = softmax_topk(logits, 4, True)
    got = call(x, *params, w, ids)
    with use_backend("reference"):
        want = call(*(t.cpu() for t in (x, *params, w, ids))).to(DEVICE)
    # bf16: seven roundings a row (products, biases, activation), each moved an ulp by the
    # reference's other summation order; the logic is checked close in fp32
    close(got, want, 4e-2 if dtype == torch.bfloat16 else 1e-5)
    form = ExpertForm(params[1].double(), params[3].double(), SwigluClamp(), True)
    oracle = moe_math(x.double(), params[0].double().transpose(1, 2), params[2].double().transpose(1, 2), w.double(),
                      ids, form)
    close(got, oracle, 5e-2 if dtype == torch.bfloat16 else 1e-5)
    # the clamp acted: without it the output differs
    plain = fused_moe(x, params[0].transpose(1, 2), params[2].transpose(1, 2), w, ids, gate_up_bias=params[1],
                      down_bias=params[3], interleaved=True)
    assert (plain.double() - got.double()).abs().max() > 0.1


def test_gpt_oss_form_backward_matches_autograd():
    experts, hidden, inter, tokens = 4, 64, 32, 50
    x = torch.randn(tokens, hidden, device=DEVICE).requires_grad_()
    params = [t.requires_grad_() for t in gpt_oss_experts(experts, hidden, inter, torch.float32)]
    w = torch.rand(tokens, 2, device=DEVICE).requires_grad_()
    ids = torch.randint(0, experts, (tokens, 2), device=DEVICE)
    g = torch.randn(tokens, hidden, device=DEVICE)
    leaves = (x, *params, w)
    got = torch.autograd.grad(call(x, *params, w, ids), leaves, g)
    dl = [t.detach().double().requires_grad_() for t in leaves]
    out = moe_math(dl[0], dl[1].transpose(1, 2), dl[3].transpose(1, 2), dl[5], ids,
                   ExpertForm(dl[2], dl[4], SwigluClamp(), True))
    want = torch.autograd.grad(out, dl, g.double())
    for a, b in zip(got, want):
        close(a, b, 1e-5)


def test_gpt_oss_form_rows_are_the_same_for_every_tile_config():
    """Each pair's activation and down rows (biases, clamp, interleaved reads) are bitwise the
    same under the decode, small and large tile configs (rule 4)."""
    experts, hidden, inter, tokens, top_k = 4, 64, 96, 37, 2
    x = torch.randn(tokens, hidden, device=DEVICE).bfloat16()
    gate_up, gate_up_bias, down, down_bias = gpt_oss_experts(experts, hidden, inter, torch.bfloat16)
    ids = torch.randint(0, experts, (tokens, top_k), device=DEVICE)
    form = ExpertForm(gate_up_bias, down_bias, SwigluClamp(), True)
    rows = []
    for cfg in (FEW_ROWS, DECODE, SMALL, LARGE):
        layout = moe_align(ids, experts, cfg.block_m)
        layout.config = cfg
        act = gate_up_act(x, gate_up.transpose(1, 2), layout, top_k, cfg, form=form)[0]
        dn = down.transpose(1, 2)
        y = grouped_gemm(act, dn, layout, hidden, inter, dn.stride(1), dn.stride(2), torch.bfloat16, cfg,
                         down_tiles=True, bias=down_bias)
        rows.append((act[layout.pair_pos], y[layout.pair_pos]))
    for act, y in rows[1:]:
        assert torch.equal(act, rows[0][0]) and torch.equal(y, rows[0][1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_tanh_and_mul_forward_and_backward(dtype):
    """Gemma's GeGLU kernel (`kernels.gelu_tanh_and_mul`, the dense MLP's other activation)
    against its reference, forward and backward, over more than one program's block."""
    from vexact_models.kernels import gelu_tanh_and_mul

    gate = (torch.randn(3, 1500, device=DEVICE) * 4).to(dtype).requires_grad_()
    up = torch.randn(3, 1500, device=DEVICE).to(dtype).requires_grad_()
    g = torch.randn(3, 1500, device=DEVICE).to(dtype)
    out = gelu_tanh_and_mul(gate, up)
    grads = torch.autograd.grad(out, (gate, up), g)
    with use_backend("reference"):
        leaves = [t.detach().cpu().requires_grad_() for t in (gate, up)]
        want = gelu_tanh_and_mul(*leaves)
        want_grads = torch.autograd.grad(want, leaves, g.cpu())
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-6
    close(out, want.to(DEVICE), tol)
    for a, b in zip(grads, want_grads):
        close(a, b.to(DEVICE), tol)
