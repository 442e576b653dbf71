"""Block-FP8 checkpoints (`vexact_models.fp8`): written here in the published layout (float8 e4m3
weights, a float32 ``weight_scale_inv`` per block, ``quantization_config`` quant_method 'fp8'),
dequantized by ``vexact dequantize-fp8`` into a bf16 checkpoint that stock transformers and our
classes load with no tensor missing or left over; its weights are the blockwise product rounded
once (transformers' own dequantization's bits, where transformers takes the shapes); our classes
and the engine refuse the FP8 checkpoint itself, naming the command."""

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from vexact_models import fp8
from vexact_models.cli import main

from .models.model_support import registered_or_skip, rel

#: 2-D weights the published FP8 checkpoints keep unquantized
UNQUANTIZED = ("embed_tokens", "lm_head", "norm", "mlp.gate.weight", "block_sparse_moe.gate.weight")


def quantize(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 e4m3 values, float32 scales) of `weight` in blocks, as the published checkpoints hold them."""
    rows, cols = weight.shape
    grid = (-(-rows // block[0]), -(-cols // block[1]))
    padded = torch.zeros(grid[0] * block[0], grid[1] * block[1])
    padded[:rows, :cols] = weight.float()
    blocks = padded.view(grid[0], block[0], grid[1], block[1])
    scale = blocks.abs().amax(dim=(1, 3)) / 448.0 + 1e-12
    values = (blocks / scale[:, None, :, None]).view_as(padded)[:rows, :cols].to(torch.float8_e4m3fn)
    return values, scale


def fp8_checkpoint(arch_name: str, folder, block: tuple[int, int]):
    """Stock transformers' tiny `arch_name` model saved by ``save_pretrained`` (per-expert hub
    layout for MoE models) into `folder`, its linear weights then stored as block FP8."""
    arch = registered_or_skip(arch_name)
    torch.manual_seed(0)
    model = arch.hf_class()(arch.tiny_config()).eval()
    model.save_pretrained(folder)
    tensors = {}
    for name, tensor in load_file(folder / "model.safetensors").items():
        if tensor.dim() == 2 and name.endswith(".weight") and not any(u in name for u in UNQUANTIZED):
            tensors[name], tensors[name.replace(".weight", ".weight_scale_inv")] = quantize(tensor, block)
        else:
            tensors[name] = tensor
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(block)}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "tokenizer_config.json").write_text("{}")
    return arch, model, tensors


@pytest.mark.compat
def test_dequantize_fp8_is_the_blockwise_product_rounded_once():
    torch.manual_seed(0)
    weight = (torch.randn(2, 37, 50) * 100).to(torch.float8_e4m3fn)
    scale = torch.rand(2, 3, 4) + 0.01
    got = fp8.dequantize_fp8(weight, scale, (16, 16))
    want = torch.empty(2, 37, 50)
    for e in range(2):
        for i in range(37):
            for j in range(50):
                want[e, i, j] = weight[e, i, j].float() * scale[e, i // 16, j // 16]
    assert got.dtype == torch.bfloat16 and torch.equal(got, want.to(torch.bfloat16))
    with pytest.raises(ValueError, match=r"shape \(2, 37, 50\) in blocks of \(16, 16\) needs float scales of "
                                         r"shape \(2, 3, 4\), got \(2, 3, 3\)"):
        fp8.dequantize_fp8(weight, scale[..., :3], (16, 16))


@pytest.mark.compat
@pytest.mark.parametrize("arch_name", ["deepseek_v3", "qwen3", "minimax_m2"])
def test_the_dequantized_checkpoint_loads_in_stock_and_ours(arch_name, tmp_path):
    """Blocks of 16: DeepSeek-V3's tiny dims leave partial blocks, as its published 576-row kv_a_proj does.
    MiniMax-M2's experts are stored per expert (``block_sparse_moe.experts.N.w1`` ...), each quantized,
    as its published FP8 checkpoint holds them; its router stays unquantized."""
    arch, model, tensors = fp8_checkpoint(arch_name, tmp_path / "fp8", (16, 16))
    target = fp8.dequantize_fp8_checkpoint(tmp_path / "fp8", tmp_path / "bf16", progress=False)
    config = json.loads((target / "config.json").read_text())
    assert "quantization_config" not in config and config["torch_dtype"] == "bfloat16"
    assert (target / "tokenizer_config.json").is_file()
    written = load_file(target / "model.safetensors")
    assert written.keys() == {n for n in tensors if not n.endswith("_scale_inv")}
    for name, tensor in written.items():
        if name + "_scale_inv" in tensors:
            assert torch.equal(tensor, fp8.dequantize_fp8(tensors[name], tensors[name + "_scale_inv"], (16, 16)))
            original = model.state_dict().get(name)
            if original is not None:
                assert rel(tensor.float(), original) < 0.1  # FP8's rounding, not a wrong block
        else:
            assert torch.equal(tensor, tensors[name])
    stock, info = arch.hf_class().from_pretrained(target, output_loading_info=True, dtype=torch.float32)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    ours = arch.causal_lm_class.from_pretrained(target, dtype=torch.float32)
    ids = torch.randint(3, 512, (2, 16))
    with torch.no_grad():
        assert rel(ours.eval()(ids).logits, stock.eval()(ids).logits) <= arch.fp32_parity


def test_the_bits_are_transformers_dequantization(tmp_path):
    """Where transformers' own dequantization takes the shapes (blocks of 8 divide every tiny
    DeepSeek-V3 weight), loading the FP8 checkpoint through it gives the converted weights' bits
    (the main suite's transformers; 5.2's dequantization imports Triton, not `compat`)."""
    arch, _, _ = fp8_checkpoint("deepseek_v3", tmp_path / "fp8", (8, 8))
    target = fp8.dequantize_fp8_checkpoint(tmp_path / "fp8", tmp_path / "bf16", progress=False)
    theirs = arch.hf_class().from_pretrained(tmp_path / "fp8", dtype=torch.bfloat16, quantization_config=(
        transformers.FineGrainedFP8Config(dequantize=True, weight_block_size=(8, 8))))
    mine = arch.hf_class().from_pretrained(target, dtype=torch.bfloat16)
    want = dict(mine.named_parameters())
    assert all(torch.equal(p, want[n]) for n, p in theirs.named_parameters())
    ours = arch.causal_lm_class.from_pretrained(tmp_path / "fp8", dtype=torch.bfloat16, quantization_config=(
        transformers.FineGrainedFP8Config(dequantize=True, weight_block_size=(8, 8))))
    assert all(torch.equal(p, want[n]) for n, p in ours.named_parameters())


@pytest.mark.compat
def test_our_classes_and_the_engine_refuse_an_fp8_checkpoint(tmp_path):
    arch, _, _ = fp8_checkpoint("qwen3", tmp_path / "fp8", (16, 16))
    with pytest.raises(ValueError, match=r"stores its weights in FP8 .*\(vexact dequantize-fp8 SOURCE TARGET"):
        arch.causal_lm_class.from_pretrained(tmp_path / "fp8")
    with pytest.raises(ValueError, match=r"vexact dequantize-fp8"):
        arch.token_classification_class.from_pretrained(tmp_path / "fp8", num_labels=1)
    from vexact_models import LLM

    with pytest.raises(ValueError, match=r"vexact dequantize-fp8"):
        LLM(str(tmp_path / "fp8"), device="cpu")


@pytest.mark.compat
def test_the_command(tmp_path, capsys):
    fp8_checkpoint("qwen3", tmp_path / "fp8", (16, 16))
    assert main(["dequantize-fp8", str(tmp_path / "fp8"), str(tmp_path / "out"), "--no-progress",
                 "--max-shard-size", "20KB"]) == 0
    assert f"wrote the bf16 checkpoint to {tmp_path / 'out'}: config.json" in capsys.readouterr().out
    assert (tmp_path / "out" / "model.safetensors.index.json").is_file()
    assert main(["dequantize-fp8", str(tmp_path / "fp8"), str(tmp_path / "out")]) == 2
    assert "exists and is not an empty folder" in capsys.readouterr().err
    shutil.copytree(tmp_path / "out", tmp_path / "plain")
    assert main(["dequantize-fp8", str(tmp_path / "plain"), str(tmp_path / "again")]) == 2
    assert "is not an FP8 checkpoint" in capsys.readouterr().err and not (tmp_path / "again").exists()


@pytest.fixture(scope="module")
def fp8_folder(tmp_path_factory):
    """A tiny block-FP8 Qwen3 checkpoint (for the command's checks of its target)."""
    folder = tmp_path_factory.mktemp("fp8") / "fp8"
    fp8_checkpoint("qwen3", folder, (16, 16))
    return folder


def test_max_shard_size_in_plain_bytes(fp8_folder, tmp_path, capsys):
    """``--max-shard-size 20000`` is bytes, as --help says (transformers takes digits only as an int)."""
    from vexact_models.checkpoint_writer import shard_bytes

    assert shard_bytes("20000", "w") == shard_bytes("20KB", "w") == shard_bytes(20000, "w") == 20000
    assert main(["dequantize-fp8", str(fp8_folder), str(tmp_path / "out"), "--max-shard-size", "20000",
                 "--no-progress"]) == 0
    assert (tmp_path / "out" / "model-00001-of-00011.safetensors").is_file()
    assert main(["dequantize-fp8", str(fp8_folder), str(tmp_path / "no"), "--max-shard-size", "0"]) == 2
    assert "max_shard_size='0' must be a positive number of bytes" in capsys.readouterr().err


def test_targets_that_cannot_be_renamed_into_place_are_refused_up_front(fp8_folder, tmp_path, capsys, monkeypatch):
    """A symbolic link (to an empty folder), the current folder, a target under a file or in a folder
    it may not write in: refused naming TARGET and why, before anything is made (the rename at the
    end failed with a traceback after all the work before)."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "link").symlink_to("empty")
    (tmp_path / "file").write_text("x")
    (tmp_path / "locked").mkdir()
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: Path(path).name != "locked" and real_access(path, mode))
    monkeypatch.chdir(tmp_path / "empty")
    for target, words in (("../link", "'../link' is a symbolic link"), (".", "'.' is the current folder"),
                          (str(tmp_path / "file" / "a" / "b"), "/file' is not a folder"),
                          (str(tmp_path / "locked" / "a" / "b"), "no permission to write in '" + str(tmp_path / "locked"))):
        assert main(["dequantize-fp8", str(fp8_folder), target, "--no-progress"]) == 2, target
        err = capsys.readouterr().err
        assert f"vexact dequantize-fp8: error: dequantize_fp8_checkpoint: target '{target}'" in err and words in err
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == ["empty", "file", "link", "locked"]


def test_a_failed_write_removes_the_folders_it_made(fp8_folder, tmp_path, monkeypatch):
    from vexact_models import checkpoint_writer

    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint_writer, "save_file", fail)
    with pytest.raises(OSError, match="disk full"):
        fp8.dequantize_fp8_checkpoint(fp8_folder, tmp_path / "t" / "deep" / "er", progress=False)
    assert not any(tmp_path.iterdir())


def test_the_folder_has_the_mode_a_plain_mkdir_gives(fp8_folder, tmp_path):
    """0o777 less the umask, as save_pretrained's folder (tempfile.mkdtemp's 0o700 stayed before)."""
    for umask in (0o022, 0o027):
        previous = os.umask(umask)
        try:
            target = fp8.dequantize_fp8_checkpoint(fp8_folder, tmp_path / f"out{umask:o}", progress=False)
        finally:
            os.umask(previous)
        assert stat.S_IMODE(target.stat().st_mode) == 0o777 & ~umask


def test_sigterm_during_the_write_leaves_nothing(tmp_path):
    """SIGTERM (a scheduler stopping the job) while the folder is staged: exit 143 with the staging
    folder and the parents made for it removed, as an exception does; the handler comes back after."""
    code = ("import os, signal, sys, time\nfrom pathlib import Path\n"
            "from vexact_models.checkpoint_writer import staged_folder\n"
            "with staged_folder(Path(sys.argv[1]), 'w') as staging:\n"
            "    (staging / 'part').write_text('x')\n"
            "    assert signal.getsignal(signal.SIGTERM) != signal.SIG_DFL\n"
            "    os.kill(os.getpid(), signal.SIGTERM)\n"
            "    time.sleep(60)\n")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "a" / "b" / "out")], timeout=120)
    assert done.returncode == 143 and not any(tmp_path.iterdir())
    from vexact_models.checkpoint_writer import staged_folder

    previous = signal.getsignal(signal.SIGTERM)
    with staged_folder(tmp_path / "out", "w") as staging:
        (staging / "f").write_text("x")
    assert signal.getsignal(signal.SIGTERM) == previous and (tmp_path / "out" / "f").is_file()


def test_a_config_that_is_no_json_is_named(tmp_path, capsys):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "config.json").write_text("{bad")
    assert main(["dequantize-fp8", str(tmp_path / "src"), str(tmp_path / "out")]) == 2
    assert f"'{tmp_path / 'src' / 'config.json'}' is not valid JSON: Expecting" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]
