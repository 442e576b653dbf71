"""``vexact serve``'s user errors (`vexact_models.serve_cli`): a port out of range is refused by the
parser, and what the engine or the server refuses (--max-model-len past the model's, a KV budget
under one block, a checkpoint without a tokenizer) is ``vexact serve: error: ...`` with exit 2, no
traceback; an address the front end cannot listen on is one line and exit 1. The server itself is
tested in test_openai_server.py."""

import socket

import pytest
import torch
import transformers

from vexact_models import qwen3
from vexact_models.cli import main

from .llm_support import save_chat_checkpoint


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_chat_checkpoint(tmp_path_factory.mktemp("serve_cli"), "{{ bos_token }}")


@pytest.mark.parametrize("port, words", [("70000", "must be <= 65535 (0: a free one), got 70000"),
                                         ("-1", "must be >= 0, got -1")])
def test_a_port_out_of_range_is_a_usage_error(folder, port, words, capsys):
    with pytest.raises(SystemExit) as info:
        main(["serve", str(folder), "--port", port])
    assert info.value.code == 2 and f"vexact serve: error: argument --port: {words}" in capsys.readouterr().err


def test_what_the_engine_refuses_is_a_usage_error(folder, tmp_path, capsys):
    """(Tracebacks and exit 1 before.)"""
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(qwen3.tiny_config()).save_pretrained(tmp_path / "no_tokenizer")
    cases = [([str(folder), "--max-model-len", "100000"], "LLM: max_model_len=100000 is outside [1, "),
             ([str(folder), "--kv-cache-bytes", "10"], "LLM: the KV cache budget (10 bytes) is smaller than one block"),
             ([str(tmp_path / "no_tokenizer")], "OpenAIServer: the engine has no tokenizer"),
             ([str(folder), "--enable-auto-tool-choice"], "--enable-auto-tool-choice needs --tool-call-parser")]
    for argv, words in cases:
        assert main(["serve", argv[0], "--device", "cpu", "--kv-cache-bytes", str(1 << 20), *argv[1:]]) == 2, argv
        err = capsys.readouterr().err
        assert f"vexact serve: error: {words}" in err and "Traceback" not in err, err


def test_an_address_it_cannot_listen_on_is_one_line(folder, capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", str(folder), "--device", "cpu", "--kv-cache-bytes", str(1 << 20), "--port", str(port)]) == 1
    assert f"vexact serve: error: OpenAIServer: cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err
