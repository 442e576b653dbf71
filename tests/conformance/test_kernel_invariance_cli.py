"""The kernel invariance CLI's shape selection (the sweep itself needs a GPU: docs/gpu-results.md)."""

import pytest

from vexact_models.conformance.attention_invariance import ATTENTION_SHAPES, LATENT_SHAPES
from vexact_models.conformance.kernel_invariance import attention_shape_names, main, selected_shapes


def test_shape_names_list_every_attention_and_latent_shape_in_order():
    assert attention_shape_names() == [s[0] for s in ATTENTION_SHAPES] + [s[0] for s in LATENT_SHAPES]
    assert "moonlight MLA" in attention_shape_names() and "deepseek-v3 latent MLA" in attention_shape_names()


def test_selected_shapes_default_to_all_and_read_a_comma_list():
    assert selected_shapes(None) == set(attention_shape_names())
    assert selected_shapes("qwen3-8b, moonlight MLA") == {"qwen3-8b", "moonlight MLA"}


@pytest.mark.parametrize("text", ["qwen3-9b", "qwen3-8b,nope", " , "])
def test_unknown_shapes_are_refused_with_the_known_ones(text):
    with pytest.raises(ValueError) as e:
        selected_shapes(text)
    assert "--shapes" in str(e.value) and "qwen3-0.6b" in str(e.value) and "deepseek-v3 MLA" in str(e.value)


def test_cli_refuses_an_unknown_shape_before_touching_the_gpu(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--only", "attention", "--shapes", "qwen3-9b"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "'qwen3-9b'" in err and "qwen3-30b-a3b" in err
