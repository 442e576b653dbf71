import pytest
import torch

from vexact_models.kernels.paged_layout import slots_reference


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64."""
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-300))


@pytest.fixture
def clean_attention_backward(monkeypatch):
    """No attention backward choice from the environment or an override, before and after."""
    from vexact_models.kernels.attention_backward_choice import ENV_VAR, set_attention_backward

    monkeypatch.delenv(ENV_VAR, raising=False)
    set_attention_backward(None)
    yield
    set_attention_backward(None)


def paged_cache(packed: torch.Tensor, lens: list[int], table: torch.Tensor, page: int) -> torch.Tensor:
    """A CPU cache ``[slots, H, D]`` holding the packed rows ``packed [sum(lens), H, D]`` of each
    sequence at the slots `table` maps them to, NaN in every other slot (a kernel that reads an
    unwritten slot turns its output NaN)."""
    cache = torch.full((int(table.max()) * page + page, *packed.shape[1:]), float("nan"), dtype=packed.dtype)
    start = 0
    for s, n in enumerate(lens):
        cache[slots_reference(table, s, torch.arange(n), page)] = packed[start:start + n].cpu()
        start += n
    return cache


def paged_layout(q_lens: list[int], seq_lens: list[int], table: torch.Tensor, page: int, device="cpu"):
    """The `PagedLayout` of sequences with `q_lens` new tokens each and `seq_lens` keys in all,
    over the block table `table` of pages of `page` slots, on `device`."""
    from vexact_models.kernels import PagedLayout

    cu = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    return PagedLayout(cu.to(device), torch.tensor(seq_lens, dtype=torch.int32, device=device), table.to(device), page,
                       max(q_lens))


def compiled_variants(kernel) -> int:
    """How many variants of a Triton/Gluon `kernel` are compiled for the current CUDA device."""
    return len(kernel.device_caches[torch.cuda.current_device()][0])


@pytest.fixture
def gemma3_too_old(monkeypatch):
    """The registry as on a transformers older than Gemma 3's ``min_transformers`` (as it is on the
    releases before 5.24): ``gemma3`` left out and recorded as needing 5.24."""
    from vexact_models import registry

    registry.architectures()  # load the built-in ones first; then swap in copies, so the order stays
    monkeypatch.setattr(registry, "_REGISTRY", {k: v for k, v in registry._REGISTRY.items() if k != "gemma3"})
    monkeypatch.setattr(registry, "_TOO_OLD", {**registry._TOO_OLD, "gemma3": "5.24"})
