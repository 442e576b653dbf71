"""SamplingParams: every field is validated with a message naming the field, value and limit."""

import dataclasses

import pytest

from vexact_models.runtime.sampling_params import SamplingParams


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"n": 0}, "SamplingParams.n=0 is below the minimum 1"),
        ({"n": True}, "SamplingParams.n=True must be an int, got bool"),
        ({"n": 2.0}, "SamplingParams.n=2.0 must be an int, got float"),
        ({"temperature": -0.5}, "SamplingParams.temperature=-0.5 is below the minimum 0"),
        ({"temperature": float("nan")}, "SamplingParams.temperature=nan must be a finite number"),
        ({"temperature": "1"}, "SamplingParams.temperature='1' must be a float, got str"),
        ({"temperature": False}, "SamplingParams.temperature=False must be a float, got bool"),
        ({"top_p": 1.5}, "SamplingParams.top_p=1.5 is outside (0, 1]"),
        ({"top_p": 0.0}, "SamplingParams.top_p=0.0 is outside (0, 1]"),
        ({"top_p": float("inf")}, "SamplingParams.top_p=inf must be a finite number"),
        ({"top_k": -2}, "SamplingParams.top_k=-2 must be -1 or 0 (off) or >= 1"),
        ({"top_k": 1.0}, "SamplingParams.top_k=1.0 must be an int, got float"),
        ({"min_p": -0.1}, "SamplingParams.min_p=-0.1 is outside [0, 1] (0: off)"),
        ({"min_p": 1.5}, "SamplingParams.min_p=1.5 is outside [0, 1] (0: off)"),
        ({"min_p": "0.1"}, "SamplingParams.min_p='0.1' must be a float, got str"),
        ({"min_tokens": -1}, "SamplingParams.min_tokens=-1 is below the minimum 0"),
        ({"max_tokens": 0}, "SamplingParams.max_tokens=0 is below the minimum 1"),
        ({"max_tokens": True}, "SamplingParams.max_tokens=True must be an int, got bool"),
        ({"min_tokens": 5, "max_tokens": 3}, "SamplingParams.min_tokens=5 exceeds max_tokens=3"),
        ({"stop_token_ids": [1, -1]}, "SamplingParams.stop_token_ids[1]=-1 is below the minimum 0"),
        ({"stop_token_ids": [1, False]}, "SamplingParams.stop_token_ids[1]=False must be an int"),
        ({"stop_token_ids": 5}, "SamplingParams.stop_token_ids=5 must be a list of ints"),
        ({"ignore_eos": 1}, "SamplingParams.ignore_eos=1 must be a bool, got int"),
        ({"seed": -2**63 - 1}, f"SamplingParams.seed={-2**63 - 1} is outside [-2**63, 2**63) (a signed 64-bit integer)"),
        ({"seed": 2**63}, f"SamplingParams.seed={2**63} is outside [-2**63, 2**63)"),
        ({"seed": True}, "SamplingParams.seed=True must be an int, got bool"),
        ({"truncate_prompt_tokens": 0},
         "SamplingParams.truncate_prompt_tokens=0 must be None, -1 (all the engine takes) or an int >= 1"),
        ({"truncate_prompt_tokens": -2}, "SamplingParams.truncate_prompt_tokens=-2 must be None, -1"),
        ({"truncate_prompt_tokens": True}, "SamplingParams.truncate_prompt_tokens=True must be None"),
        ({"spaces_between_special_tokens": 0}, "SamplingParams.spaces_between_special_tokens=0 must be a bool"),
    ],
)
def test_invalid_values_name_field_value_and_limit(kwargs, message):
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    assert message in str(info.value)


def test_defaults_and_boundary_values_are_accepted():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k) == (1, 1.0, 1.0, -1)
    assert (p.min_tokens, p.max_tokens, p.stop_token_ids, p.ignore_eos, p.seed) == (
        0, 16, [], False, None,
    )
    edge = SamplingParams(
        temperature=0, top_p=1e-9, top_k=1, min_tokens=4, max_tokens=4,
        stop_token_ids=(0, 3), seed=2**63 - 1,
    )
    assert SamplingParams(seed=-2**63).seed == -2**63  # kept as given (vLLM's int64 range)
    assert edge.temperature == 0.0 and isinstance(edge.temperature, float)
    assert edge.stop_token_ids == [0, 3] and isinstance(edge.stop_token_ids, list)


def test_temperatures_below_vllms_epsilon_are_greedy():
    """vLLM samples greedily below 1e-5 (logits divided by such a temperature overflow fp32)."""
    from vexact_models.runtime.sampling_params import GREEDY_BELOW

    assert GREEDY_BELOW == 1e-5
    assert SamplingParams(temperature=1e-40).temperature == 0.0
    assert SamplingParams(temperature=9.9e-6).temperature == 0.0
    assert SamplingParams(temperature=1e-5).temperature == 1e-5


def test_replace_copies_and_revalidates():
    base = SamplingParams(stop_token_ids=[7], seed=3)
    copy = dataclasses.replace(base, temperature=0.5)
    assert copy.temperature == 0.5 and copy.seed == 3 and copy.stop_token_ids == [7]
    copy.stop_token_ids.append(9)  # a copy never aliases the original's list
    assert base.stop_token_ids == [7]
    with pytest.raises(ValueError, match="top_p=2"):
        dataclasses.replace(base, top_p=2.0)


def test_vllms_spellings_of_none_and_all_are_taken_as_vllm_reads_them():
    """``stop=None`` and ``stop_token_ids=None`` are none, ``top_k=0`` all tokens, ``max_tokens=None``
    up to the engine's ``max_model_len`` (`UNBOUNDED_TOKENS`), as vLLM's; a copy reads the same."""
    from vexact_models.runtime.sampling_params import UNBOUNDED_TOKENS

    params = SamplingParams(stop=None, stop_token_ids=None, top_k=0, max_tokens=None)
    assert (params.stop, params.stop_token_ids, params.top_k, params.max_tokens) == ([], [], -1, UNBOUNDED_TOKENS)
    assert dataclasses.replace(params, n=2).max_tokens == UNBOUNDED_TOKENS
    with pytest.raises(ValueError, match="min_tokens=5 exceeds max_tokens=3"):
        SamplingParams(max_tokens=3, min_tokens=5)


def test_a_stop_string_holds_back_what_it_could_still_be_forming_unless_the_text_keeps_it():
    from vexact_models.runtime.stop_strings import stop_holdback

    assert stop_holdback(SamplingParams()) == 0 and stop_holdback(SamplingParams(stop=["ab", "wxyz"])) == 3
    assert stop_holdback(SamplingParams(stop=["wxyz"], include_stop_str_in_output=True)) == 0
