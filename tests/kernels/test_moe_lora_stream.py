"""The routed experts' LoRA operands begun beside the expert GEMMs (`moe_lora.moe_lora_shrink_beside`,
`kernels/streams.py`): only inside a CUDA-graph capture without autograd; elsewhere the launcher
runs the summing shrink and B's copy in line. The CPU tests cover the fallbacks and the switch;
the capture is the `gpu` test, which also changes B in place between replays (the copy by expert
is made inside the graph, so a replay reads B as it is then)."""

import pytest
import torch

from vexact_models.kernels import ExpertLora, fused_moe
from vexact_models.kernels.moe_align import MoeLayout
from vexact_models.kernels.moe_config import DECODE
from vexact_models.kernels.moe_lora import moe_lora_add_triton, moe_lora_shrink_beside
from vexact_models.kernels.streams import LORA_SHRINK, forks_here, side_stream

EXPERTS, HIDDEN, INTER, RANK, TOP_K = 8, 64, 32, 4, 2


def adapters(device: str, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, ExpertLora, ExpertLora]:
    """Expert tensors (bf16) and an fp32 adapter on each, in PEFT's layout."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda *shape, s=1.0: (torch.randn(*shape, generator=g) * s).to(device)  # noqa: E731
    gate_up = rand(EXPERTS, 2 * INTER, HIDDEN, s=HIDDEN ** -0.5).bfloat16()
    down = rand(EXPERTS, HIDDEN, INTER, s=INTER ** -0.5).bfloat16()
    return (gate_up, down, ExpertLora(rand(EXPERTS * RANK, HIDDEN, s=HIDDEN ** -0.5), rand(2 * INTER, RANK * EXPERTS), 2.0),
            ExpertLora(rand(EXPERTS * RANK, INTER, s=INTER ** -0.5), rand(HIDDEN, RANK * EXPERTS), 0.5))


def cpu_layout(tokens: int) -> MoeLayout:
    rows = 64
    return MoeLayout(torch.zeros(rows, dtype=torch.int32), torch.zeros(tokens * TOP_K, dtype=torch.int32),
                     torch.zeros(rows // DECODE.block_m, dtype=torch.int32), torch.zeros(EXPERTS + 1, dtype=torch.int32),
                     tokens * TOP_K, DECODE)


def test_operands_stay_in_line_outside_a_capture():
    """On CPU (or outside a capture, or with autograd on) nothing forks: `forks_here` is False and
    `moe_lora_shrink_beside` gives None under either switch value."""
    _, _, lora, _ = adapters("cpu")
    x = torch.randn(3, HIDDEN)
    assert not forks_here(x)
    with torch.no_grad():
        for mode in ("side", "inline"):
            with LORA_SHRINK.use(mode):
                assert moe_lora_shrink_beside(x, lora, cpu_layout(3), EXPERTS, TOP_K, True) is None


def test_switch_names_the_variable_and_the_modes(monkeypatch):
    monkeypatch.setenv("VEXACT_LORA_SHRINK", "parallel")
    _, _, lora, _ = adapters("cpu")
    with pytest.raises(ValueError, match=r"VEXACT_LORA_SHRINK='parallel'.*'side', 'inline'"):
        moe_lora_shrink_beside(torch.randn(2, HIDDEN), lora, cpu_layout(2), EXPERTS, TOP_K, True)


def test_started_operands_are_refused_where_u_is_kept():
    """The training forward keeps u from its own shrink: operands begun for the rollout are an error
    there, named, before anything is launched."""
    _, _, lora, _ = adapters("cpu")
    base = torch.zeros(64, 2 * INTER)
    with pytest.raises(ValueError, match=r"moe_lora_add_triton: started .* keep_u=True"):
        moe_lora_add_triton(base, torch.randn(2, HIDDEN), lora, cpu_layout(2), EXPERTS, TOP_K, True, keep_u=True,
                            started=((torch.zeros(1), (torch.zeros(1), (1, 1, 1))), None))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (streams, CUDA graphs)")
@pytest.mark.parametrize("tokens", [4, 64])  # B read in place, and copied by expert
def test_operands_run_beside_the_expert_gemms_in_a_graph_with_the_in_line_bits(tokens, monkeypatch):
    """`fused_moe` with both expert tensors adapted, captured in a CUDA graph: with ``side`` each
    tensor's operands (the summing shrink, B's copy) are made on the side stream, with ``inline``
    on the capturing one; every replay equals the eager call bitwise, also after B changed in place
    between replays."""
    from vexact_models.kernels import moe_lora

    gate_up, down, gu_lora, dn_lora = adapters("cuda")
    streams = []
    real = moe_lora.rollout_operands
    monkeypatch.setattr(moe_lora, "rollout_operands",
                        lambda *args: streams.append(torch.cuda.current_stream()) or real(*args))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, HIDDEN, generator=g).cuda().bfloat16()
    w, ids = torch.softmax(torch.randn(tokens, EXPERTS, generator=g), -1).topk(TOP_K, -1)
    w, ids = w.cuda(), ids.cuda()

    def forward(inp):
        return fused_moe(inp, gate_up, down, w, ids, gate_up_lora=gu_lora, down_lora=dn_lora)

    with torch.no_grad():
        want = forward(x)
        assert len(streams) == 2 and all(s == torch.cuda.current_stream() for s in streams)  # eager: in line
        streams.clear()
        for mode in ("side", "inline"):
            graph, static = torch.cuda.CUDAGraph(), x.clone()
            with LORA_SHRINK.use(mode):
                with torch.cuda.graph(graph):
                    capturing = torch.cuda.current_stream()
                    captured = forward(static)
            expected = side_stream(x.device) if mode == "side" else capturing
            assert len(streams) == 2 and all(s == expected for s in streams), (mode, streams)
            streams.clear()
            for _ in range(3):
                captured.zero_()
                graph.replay()
                assert torch.equal(captured, want)
            for lora in (gu_lora, dn_lora):
                lora.b.mul_(-2.0)  # an optimizer step or a weight update between replays
            changed = forward(x)
            streams.clear()
            graph.replay()
            assert torch.equal(captured, changed) and not torch.equal(changed, want)
            for lora in (gu_lora, dn_lora):
                lora.b.div_(-2.0)
