"""GPT-OSS's MXFP4 checkpoints (`vexact_models.mxfp4`): a real tiny one, written here in the layout
published GPT-OSS checkpoints and transformers' ``integrations/mxfp4.py`` use (the experts'
``*_blocks`` / ``*_scales`` uint8 tensors, ``quantization_config`` quant_method ``mxfp4``), loads
through ``patch()`` + ``AutoModelForCausalLM`` and through our own routes (our class, ``LLM(path)``,
the pipeline stages' loader) into the very weights stock transformers dequantizes, with stock's
logits, and rolls out with the training recompute's logprobs bitwise."""

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from vexact_models.mxfp4 import FP4_VALUES, dequantize_mxfp4
from vexact_models.registry import architectures

from .model_support import check_rollouts_equal_recompute, rel, stock_model

ARCHS = {arch.name: arch for arch in architectures()}
if "gpt_oss" not in ARCHS:  # Architecture.min_transformers keeps it out on older releases
    pytest.skip(f"GPT-OSS needs a newer transformers than {transformers.__version__}", allow_module_level=True)
ARCH = ARCHS["gpt_oss"]
#: what the published gpt-oss-20b config says
QUANTIZATION = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                                   "model.embed_tokens", "lm_head"]}


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A model's expert weight ``[experts, in, out]`` as the checkpoint's MXFP4 pair: each group of
    32 ``in`` values of an output row scaled by the smallest power of two that brings its largest
    magnitude within 6 (e8m0, biased by 127), each value rounded to the nearest e2m1 code (the
    first of two equally near), two codes a byte with the even element in the low nibble."""
    rows = weight.transpose(1, 2).float()  # [experts, out, in]: the stored orientation
    experts, out, width = rows.shape
    groups = rows.reshape(experts, out, width // 32, 32)
    amax = groups.abs().amax(-1)
    exponent = torch.where(amax > 0, torch.ceil(torch.log2(amax / 6.0)), torch.zeros_like(amax)).clamp(-127, 127)
    scaled = groups / torch.exp2(exponent)[..., None]
    codes = (scaled[..., None] - torch.tensor(FP4_VALUES)).abs().argmin(-1)  # +0.0 (code 0) before -0.0 (code 8)
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    return blocks, (exponent + 127).to(torch.uint8)


@pytest.fixture(scope="module")
def mxfp4_checkpoint(tmp_path_factory):
    """A tiny random GPT-OSS (sinks and expert biases random too) saved by stock transformers, its
    expert weights then replaced by their MXFP4 pair and the config given the published
    ``quantization_config``: ``(folder, {weight name: (blocks, scales)})``."""
    folder = tmp_path_factory.mktemp("gpt-oss-mxfp4")
    stock_model(ARCH, initializer_range=0.1).save_pretrained(folder)
    tensors = load_file(folder / "model.safetensors")
    pairs = {}
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        pairs[name] = quantize_mxfp4(tensors.pop(name))
        tensors[name + "_blocks"], tensors[name + "_scales"] = pairs[name]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = QUANTIZATION
    (folder / "config.json").write_text(json.dumps(config))
    assert len(pairs) == 2 * 3 and pairs["model.layers.0.mlp.experts.gate_up_proj"][0].shape == (8, 64, 2, 16)
    return folder, pairs


def stock_dequantized(folder) -> torch.nn.Module:
    """Stock transformers' own load of the folder, dequantized in fp32, eager attention (sinks)."""
    model = transformers.GptOssForCausalLM.from_pretrained(
        folder, quantization_config=transformers.Mxfp4Config(dequantize=True), dtype=torch.float32).eval()
    model.config._attn_implementation = "eager"
    return model


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dequantize_mxfp4_is_transformers_dequantization_bitwise(dtype):
    """Random codes and scales (2**-20 .. 2**20): bitwise transformers' ``convert_moe_packed_tensors``;
    one group worked by hand (codes 1, 15 -> 0.5, -6.0; scale 129 -> x4)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks = torch.randint(0, 256, (3, 24, 4, 16), dtype=torch.uint8)
    scales = torch.randint(107, 148, (3, 24, 4), dtype=torch.uint8)
    got = dequantize_mxfp4(blocks, scales, dtype)
    assert got.shape == (3, 128, 24) and got.dtype == dtype
    assert torch.equal(got, convert_moe_packed_tensors(blocks, scales, dtype=dtype))
    blocks[0, 5, 2, 0], scales[0, 5, 2] = 0xF1, 129
    got = dequantize_mxfp4(blocks, scales, dtype)
    assert got[0, 64:66, 5].tolist() == [2.0, -24.0]


def test_dequantize_mxfp4_rejects_other_layouts():
    with pytest.raises(ValueError, match=r"must be uint8, got torch.int32"):
        dequantize_mxfp4(torch.zeros(2, 4, 1, 16, dtype=torch.int32), torch.zeros(2, 4, 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"blocks must be \[experts, out, groups, 16\].*\(2, 4, 1, 8\)"):
        dequantize_mxfp4(torch.zeros(2, 4, 1, 8, dtype=torch.uint8), torch.zeros(2, 4, 1, dtype=torch.uint8))


def test_quantize_mxfp4_round_trips_representable_weights():
    """The fixture's quantizer is exact on weights MXFP4 holds (FP4 values times a power of two per
    group), so the checkpoint stands for the weights it was made from."""
    codes = torch.randint(0, 16, (2, 64, 8))  # [experts, in, out]
    weight = torch.tensor(FP4_VALUES)[codes] * torch.exp2(torch.randint(-4, 4, (2, 2, 1, 8)).float()).repeat_interleave(
        32, 1).reshape(2, 64, 8)
    weight[:, :32, 3] = 0.0  # an all-zero group
    assert torch.equal(dequantize_mxfp4(*quantize_mxfp4(weight), torch.float32), weight)


def test_mxfp4_checkpoint_loads_as_stock_dequantizes_it(mxfp4_checkpoint):
    """Through ``patch()`` + ``AutoModelForCausalLM`` with ``Mxfp4Config(dequantize=True)`` and through
    our class directly: every tensor equals stock's dequantized load (the experts `dequantize_mxfp4`
    of the stored pair), and the fp32 logits are within 1e-5 of stock's."""
    import vexact_models

    folder, pairs = mxfp4_checkpoint
    stock = stock_dequantized(folder)
    stock_params = dict(stock.named_parameters())
    for name, (blocks, scales) in pairs.items():
        assert torch.equal(stock_params[name], dequantize_mxfp4(blocks, scales, torch.float32))
    ids = torch.randint(3, 512, (2, 24))
    with torch.no_grad():
        want = stock(ids).logits
    vexact_models.patch()
    try:
        auto = transformers.AutoModelForCausalLM.from_pretrained(
            folder, quantization_config=transformers.Mxfp4Config(dequantize=True), dtype=torch.float32)
    finally:
        vexact_models.unpatch()
    direct = ARCH.causal_lm_class.from_pretrained(folder, quantization_config=transformers.Mxfp4Config(dequantize=True),
                                                  dtype=torch.float32)
    for ours in (auto, direct):
        assert isinstance(ours, ARCH.causal_lm_class)
        assert all(torch.equal(p, stock_params[n]) for n, p in ours.named_parameters())
        with torch.no_grad():
            assert rel(ours.eval()(ids).logits, want) <= 1e-5


def test_mxfp4_checkpoint_rolls_out_as_training_recomputes(mxfp4_checkpoint):
    """``LLM(path)`` dequantizes by itself (the engine's `from_pretrained_complete`): the weights are
    stock's dequantized ones, and every sampled token's logprob equals ``token_logprobs`` bitwise.
    The pipeline stages' loader reads the pairs itself (`dequantize_mxfp4`) into the same weights."""
    from vexact_models import LLM
    from vexact_models.runtime.pipeline import PipelineStage
    from vexact_models.runtime.pipeline_load import load_stage_model

    folder, _ = mxfp4_checkpoint
    stock_params = dict(stock_dequantized(folder).named_parameters())
    llm = LLM(str(folder), dtype=torch.float32, device="cpu", block_size=4, kv_cache_bytes=1 << 20)
    model = llm.model.causal_lm  # the training model the engine wraps
    assert all(torch.equal(p, stock_params[n]) for n, p in model.named_parameters())
    check_rollouts_equal_recompute(llm, max_tokens=12)
    config = transformers.AutoConfig.from_pretrained(folder)
    staged = load_stage_model(str(folder), ARCH, config, torch.float32, PipelineStage(0, 1, range(3), 3),
                              torch.device("cpu"))
    assert all(torch.equal(p, stock_params[n]) for n, p in staged.named_parameters())


def test_mxfp4_checkpoint_without_dequantize_says_what_to_pass(mxfp4_checkpoint):
    folder, _ = mxfp4_checkpoint
    with pytest.raises(ValueError, match=r"MXFP4.*quantization_config=transformers\.Mxfp4Config\(dequantize=True\)"):
        ARCH.causal_lm_class.from_pretrained(folder)
