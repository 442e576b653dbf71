"""The conformance suite's command line, `vexact-conformance` (`vexact_models.conformance.cli`):
one table row per architecture x shape, the selection options (--arch, --shape, --config,
--scenario), LoRA rows, progress and recompute bounds, and every bad argument refused as a
usage error before a model is built. The suite and the model-building library it drives are
tested in test_conformance.py."""

import pytest
import torch

from vexact_models.conformance.cli import main
from vexact_models.conformance.models import published_shape
from vexact_models.registry import get

from ..models.model_support import SHAPES


def table_rows(out: str) -> list[tuple[str, str]]:
    """(architecture, shape) of each row of the printed table."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:2] == ["architecture", "shape"])
    return [tuple(line.split()[:2]) for line in lines[start + 1:] if line and not line.startswith("RESULT")]


def test_cli_prints_one_row_per_architecture_and_shape(capsys):
    """One scenario per row (tests/conformance/test_conformance.py runs them all)."""
    assert main(["--pool", "6", "--max-tokens", "4", "--prompt-len", "8", "--scenario", "batch 1"]) == 0
    out = capsys.readouterr().out
    assert "logprobs checked" in out and "RESULT: PASS" in out
    assert table_rows(out) == [(arch.name, shape.name) for arch, shape in SHAPES]


def test_cli_runs_one_shape(capsys):
    assert main(["--arch", "deepseek_v3", "--shape", "moonlight", "--parity-only"]) == 0
    out = capsys.readouterr().out
    assert table_rows(out) == [("deepseek_v3", "moonlight")] and "RESULT: PASS" in out


def test_cli_config_path_picks_the_architecture_from_its_model_type(capsys, tmp_path):
    path = tmp_path / "my-moonlight.json"
    get("deepseek_v3").shape("moonlight").tiny_config(num_hidden_layers=2).to_json_file(path)
    assert published_shape(str(path)) == (get("deepseek_v3"), None)
    assert main(["--config", str(path), "--parity-only"]) == 0
    assert table_rows(capsys.readouterr().out) == [("deepseek_v3", "my-moonlight")]


@pytest.mark.parametrize("argv, words", [
    (["--arch", "moonlight"], ["'moonlight' is a shape of architecture 'deepseek_v3'", "--arch deepseek_v3 --shape moonlight"]),
    (["--arch", "nope"], ["--arch nope: unknown architecture 'nope'", "qwen3"]),
    (["--shape", "nope"], ["--shape nope: no such shape", "deepseek_v3/moonlight"]),
    (["--arch", "qwen3", "--shape", "moonlight"], ["--shape moonlight: no such shape", "qwen3/qwen3"]),
    (["--config", "moonlight-16b-a3b", "--arch", "qwen3"], ["config of architecture 'deepseek_v3'", "not --arch qwen3"]),
    (["--config", "moonlight-16b-a3b", "--shape", "deepseek_v3"], ["sets the shape (moonlight)"]),
    (["--config", "nope"], ["no such file, and not one of the bundled configs"]),
    (["--pool", "0"], ["argument --pool: must be >= 1, got 0"]),
    (["--lora", "-1"], ["argument --lora: must be >= 0, got -1"]),
    (["--recompute-tokens", "0"], ["argument --recompute-tokens: must be >= 1, got 0"]),
    (["--layers", "0"], ["argument --layers: must be >= 1, got 0"]),  # a model of no layers checks nothing
    (["--max-positions", "-5"], ["argument --max-positions: must be >= 1, got -5"]),
    (["--pool", "x"], ["argument --pool: expected an integer, got 'x'"]),
    (["--set", "foo"], ["--set 'foo': expected KEY=VALUE"]),
    (["--arch", "deepseek_v3", "--set", "mla_kv_cache=bogus"], ["mla_kv_cache='bogus' is not an MLA KV cache mode"]),
    (["--arch", "qwen3", "--set", "num_hidden_layer=1"],
     ["config override num_hidden_layer=1: Qwen3Config has no field 'num_hidden_layer' (did you mean num_hidden_layers"]),
    (["--device", "tpu"], ["argument --device: expected cpu, cuda or cuda:N, got 'tpu'"]),
    (["--device", "cuda:99"], ["argument --device: 'cuda:99': "]),  # "no CUDA device here" or "has N CUDA device(s)"
    (["--backend", "reference", "--device", "cuda:0"], ["argument --device: 'cuda:0'" if not torch.cuda.is_available()
                                                        else "--backend reference runs on CPU only"]),
    (["--attention-forward", "fa4"], ["--attention-forward fa4 needs --device cuda (got --device cpu)"]),
    (["--attention-forward", "flash"], ["invalid choice: 'flash'"]),
    # contradictory: each ran nothing and printed RESULT: PASS
    (["--parity-only", "--no-hf-parity"], ["--parity-only and --no-hf-parity contradict each other"]),
    (["--parity-only", "--lora", "4"], ["--parity-only and --lora 4 contradict each other: --lora skips HF parity"]),
    (["--parity-only", "--scenario", "batch 1"], ["--parity-only and --scenario contradict each other"]),
])
def test_cli_rejects_bad_arguments_before_building_anything(argv, words, capsys, monkeypatch):
    monkeypatch.setattr("vexact_models.conformance.cli.build_model", None)  # building anything would raise
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    for word in words:
        assert word in err, (word, err)


def test_cli_names_the_transformers_an_architecture_needs(gemma3_too_old, capsys):
    with pytest.raises(SystemExit) as info:
        main(["--arch", "gemma3"])
    assert info.value.code == 2
    assert "--arch gemma3: architecture 'gemma3' needs transformers >= 5.24" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["qwen3", "qwen3_moe"])
def test_cli_checks_rollouts_with_lora_adapters(name, capsys):
    """The log says what `--lora` adapted. The tiny Qwen3: 2 layers x 7 projections. The tiny
    Qwen3-MoE (layers 0 and 2 sparse, 1 dense): 3 layers' attention projections, both fused expert
    tensors and the router weight of each sparse layer, which PEFT's ``all-linear`` adds on MoE models;
    from PEFT 0.22, which reads ``all-linear`` by leaf names there, the dense layer's 3 projections too."""
    import peft
    from packaging.version import Version

    dense_mlp = 3 if Version(peft.__version__) >= Version("0.22") else 0
    adapted = {"qwen3": "14 linear layers",
               "qwen3_moe": f"{12 + dense_mlp} linear layers, 4 fused expert tensors and 2 router weights"}[name]
    assert main(["--arch", name, "--lora", "4", "--pool", "8", "--max-tokens", "6", "--prompt-len", "8"]) == 0
    out = capsys.readouterr().out
    assert f"  PEFT LoRA r 4 (random adapters) on {adapted}\n" in out
    assert "RESULT: PASS" in out


def test_backend_triton_on_cpu_is_a_usage_error_unless_interpreting(monkeypatch, capsys):
    """``--backend triton --device cpu`` needs Triton's CPU interpreter: without TRITON_INTERPRET=1
    it is refused up front, naming both options and the way out."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(SystemExit) as info:
        main(["--backend", "triton", "--device", "cpu"])
    assert info.value.code == 2
    assert "--backend triton needs --device cuda (got --device cpu), or TRITON_INTERPRET=1" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("argv", [["--device", "cuda"], ["--device", "cuda:0", "--config", "tiny", "--arch", "qwen3"]])
def test_tiny_configs_on_cuda_are_a_usage_error_naming_the_way_out(argv, capsys, monkeypatch):
    """The tiny configs' head dims are below the GPU attention's smallest: refused up front, not a
    kernel's UnsupportedError after the model is built."""
    monkeypatch.setattr("vexact_models.conformance.cli.build_model", None)
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2 and "the tiny test configs' are smaller: pass --config NAME" in capsys.readouterr().err


def test_cli_runs_only_the_named_scenarios(capsys):
    rc = main(["--arch", "qwen3", "--pool", "8", "--max-tokens", "4", "--prompt-len", "8", "--no-hf-parity",
               "--scenario", "n=4"])
    out = capsys.readouterr().out
    assert rc == 0 and "batch 7, n=4:" in out
    assert "batch 1:" not in out and "preemption" not in out and "chunk 128" not in out
    with pytest.raises(SystemExit):
        main(["--arch", "qwen3", "--pool", "8", "--scenario", "batch 64"])
    assert "matches none" in capsys.readouterr().err


def test_cli_progress_shows_where_a_long_run_is(capsys):
    """--progress: the engine's bar while a scenario rolls out (stderr) and a line when its
    recompute begins, with the tokens rolled out; --no-progress (and a run whose stderr is not a
    terminal, the default here) prints neither."""
    argv = ["--arch", "qwen3", "--pool", "6", "--max-tokens", "4", "--prompt-len", "8", "--no-hf-parity",
            "--scenario", "n=4"]
    assert main(argv + ["--progress"]) == 0
    captured = capsys.readouterr()
    line = next(x for x in captured.out.splitlines() if "rolled out" in x)
    assert line.strip().startswith("batch 7, n=4: rolled out ") and line.endswith("s); recomputing"), line
    assert int(line.split("rolled out ")[1].split()[0]) > 0 and "generate" in captured.err
    done = next(x for x in captured.out.splitlines() if "recomputed in" in x)
    assert done.strip().startswith("batch 7, n=4: recomputed in ") and "peak" not in done, done  # peak: CUDA only
    assert main(argv) == 0 and main(argv + ["--no-progress"]) == 0
    captured = capsys.readouterr()
    assert "rolled out" not in captured.out and "generate" not in captured.err


def test_cli_recompute_tokens_bounds_every_recompute_forward(monkeypatch, capsys):
    """--recompute-tokens reaches the recompute: every forward of the recompute (its token count
    read off `token_logprobs`'s inputs) stays within it, except a sample longer than it, alone; the
    suite still passes."""
    from vexact_models.causal_lm import CausalLMMixin

    sizes = []  # (tokens, sequences) of each recompute forward
    real = CausalLMMixin.token_logprobs

    def counted(self, input_ids, attention_mask=None, position_ids=None, cu_seqlens=None, **kwargs):
        if attention_mask is not None:
            sizes.append((int(attention_mask.sum()), attention_mask.shape[0]))
        else:
            sizes.append((input_ids.numel(), len(cu_seqlens) - 1))
        return real(self, input_ids, attention_mask, position_ids, cu_seqlens, **kwargs)

    monkeypatch.setattr(CausalLMMixin, "token_logprobs", counted)
    argv = ["--arch", "qwen3", "--pool", "8", "--max-tokens", "6", "--prompt-len", "12", "--no-hf-parity",
            "--scenario", "batch 7, chunk", "--recompute-tokens", "20"]
    assert main(argv) == 0
    assert "0 mismatches" in capsys.readouterr().out
    assert len(sizes) > 8 and all(tokens <= 20 or seqs == 1 for tokens, seqs in sizes), sizes
    assert any(seqs > 1 for _, seqs in sizes), sizes  # ... and not one sample a forward either

