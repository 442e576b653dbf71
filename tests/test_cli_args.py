"""The argparse types the command lines share (`vexact_models.cli_args`): each value a parser
takes, and each refusal's message as argparse prints it (option, value, limit; exit 2)."""

import argparse

import pytest
import torch

from vexact_models.cli_args import (architecture_arg, chat_template_arg, checkpoint_arg, config_arg, device_arg,
                                    non_negative_float, non_negative_int, positive_float, positive_int)


@pytest.mark.parametrize("kind,text,value", [
    (positive_int, "3", 3), (non_negative_int, "0", 0), (positive_float, "0.5", 0.5), (non_negative_float, "0", 0.0),
    (device_arg, "cpu", torch.device("cpu")),
])
def test_good_values_parse(kind, text, value):
    assert kind(text) == value


@pytest.mark.parametrize("kind,text,words", [
    (positive_int, "0", "must be >= 1, got 0"), (positive_int, "x", "expected an integer, got 'x'"),
    (positive_int, "1.5", "expected an integer, got '1.5'"), (non_negative_int, "-3", "must be >= 0, got -3"),
    (positive_float, "0", "must be a finite number > 0, got 0"), (positive_float, "inf", "finite number > 0, got inf"),
    (non_negative_float, "-1", "must be a finite number >= 0, got -1"),
    (non_negative_float, "nan", "finite number >= 0, got nan"), (non_negative_float, "y", "expected a number, got 'y'"),
    (device_arg, "tpu", "expected cpu, cuda or cuda:N, got 'tpu'"), (device_arg, "", "expected cpu, cuda or cuda:N"),
    (device_arg, "cuda:99", "'cuda:99': "),
])
def test_bad_values_are_refused_with_the_value_and_the_limit(kind, text, words):
    with pytest.raises(argparse.ArgumentTypeError) as info:
        kind(text)
    assert words in str(info.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA")
def test_cuda_without_a_cuda_device_says_so_before_anything_runs(capsys):
    parser = argparse.ArgumentParser(prog="tool")
    parser.add_argument("--device", type=device_arg, default="cpu")
    assert parser.parse_args([]).device == torch.device("cpu")  # a string default goes through the type too
    with pytest.raises(SystemExit) as info:
        parser.parse_args(["--device", "cuda"])
    assert info.value.code == 2
    assert "tool: error: argument --device: 'cuda': no CUDA device here (torch " in capsys.readouterr().err


def test_checkpoint_arg_takes_a_checkpoint_folder_or_a_hub_id(tmp_path):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text("{}")
    (tmp_path / "empty").mkdir()
    (tmp_path / "file").write_text("x")
    assert checkpoint_arg(str(tmp_path / "ckpt")) == str(tmp_path / "ckpt")
    assert checkpoint_arg("Qwen/Qwen3-0.6B") == "Qwen/Qwen3-0.6B"  # left to from_pretrained and the hub
    for name, words in (("empty", "is not a checkpoint folder (it holds no config.json)"),
                        ("file", "is not a checkpoint folder"), ("nope", "no such folder")):
        with pytest.raises(argparse.ArgumentTypeError, match=words.replace("(", r"\(").replace(")", r"\)")):
            checkpoint_arg(str(tmp_path / name))
    with pytest.raises(argparse.ArgumentTypeError, match="no such folder"):
        checkpoint_arg("./no/such/checkpoint")


def test_config_arg_takes_tiny_bundled_names_and_config_files_of_registered_types(tmp_path):
    (tmp_path / "mine.json").write_text('{"model_type": "qwen3"}')
    (tmp_path / "gpt2.json").write_text('{"model_type": "gpt2"}')
    assert [config_arg(t) for t in ("tiny", "qwen3-0.6b", str(tmp_path / "mine.json"))] == [
        "tiny", "qwen3-0.6b", str(tmp_path / "mine.json")]
    with pytest.raises(argparse.ArgumentTypeError, match="not one of the bundled configs"):
        config_arg("nosuch")
    with pytest.raises(argparse.ArgumentTypeError, match="no registered architecture serves model_type 'gpt2'"):
        config_arg(str(tmp_path / "gpt2.json"))


def test_architecture_arg_takes_a_name_or_a_model_type_and_says_why_it_refuses(gemma3_too_old):
    assert architecture_arg("qwen3_5").name == "qwen3_5"
    assert architecture_arg("qwen3_5_text").name == "qwen3_5"  # the model_type its text model serves
    with pytest.raises(argparse.ArgumentTypeError, match=r"unknown architecture 'gpt2'; registered: \[.*'qwen3'"):
        architecture_arg("gpt2")
    with pytest.raises(argparse.ArgumentTypeError,
                       match=r"'gemma3' needs transformers >= 5.24 .* transformers \S+ is installed"):
        architecture_arg("gemma3")


def test_chat_template_arg_takes_a_file_or_a_template(tmp_path):
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    path = tmp_path / "t.jinja"
    path.write_text(template)
    assert chat_template_arg(str(path)) == template
    assert chat_template_arg(template) == template
    with pytest.raises(argparse.ArgumentTypeError, match="'no/such.jinja' is neither a file nor a Jinja template"):
        chat_template_arg("no/such.jinja")
