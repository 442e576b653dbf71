"""The package's public names: `vexact_models.LLM` and `vexact_models.SamplingParams` (exported
lazily, so that ``import vexact_models`` + ``patch()`` does not load the kernels), and the
package docstring's example, run as written."""

import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

import vexact_models
import vexact_models.runtime
from vexact_models.qwen3 import Qwen3ForCausalLM, tiny_config


def test_llm_and_sampling_params_are_exported():
    assert vexact_models.LLM is vexact_models.runtime.LLM
    assert vexact_models.SamplingParams is vexact_models.runtime.SamplingParams
    from vexact_models import LLM, SamplingParams  # noqa: F401  (the from-import form)

    assert {"LLM", "SamplingParams", "patch", "unpatch", "is_patched"} <= set(vexact_models.__all__)
    assert all(hasattr(vexact_models, name) for name in vexact_models.__all__)
    assert {"LLM", "SamplingParams"} <= set(dir(vexact_models))
    with pytest.raises(AttributeError, match="no attribute 'Engine'"):
        vexact_models.Engine  # noqa: B018


def test_package_import_stays_light():
    code = ("import sys, vexact_models; "
            "assert 'vexact_models.runtime' not in sys.modules and 'vexact_models.kernels' not in sys.modules; "
            "vexact_models.LLM; assert 'vexact_models.runtime' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_package_docstring_example(tmp_path):
    """The example at the top of ``vexact_models/__init__.py``, on a tiny random checkpoint."""
    assert "vexact_models.LLM(model)" in vexact_models.__doc__ and "vexact_models.SamplingParams(" in vexact_models.__doc__
    torch.manual_seed(0)
    Qwen3ForCausalLM(tiny_config(initializer_range=0.5)).save_pretrained(tmp_path)
    prompt_ids = [5, 6, 7, 8]
    vexact_models.patch()
    try:
        model = AutoModelForCausalLM.from_pretrained(tmp_path)
    finally:
        vexact_models.unpatch()
    assert type(model) is Qwen3ForCausalLM
    llm = vexact_models.LLM(model, device="cpu", kv_cache_bytes=1 << 20)
    out = llm.generate([prompt_ids], vexact_models.SamplingParams(temperature=1.0, max_tokens=64, seed=0),
                       use_tqdm=False)[0]
    ids = torch.tensor([out.prompt_token_ids + out.outputs[0].token_ids])
    with torch.no_grad():
        logprobs = model.token_logprobs(ids)
    assert torch.equal(logprobs[0, len(prompt_ids):], torch.tensor(out.outputs[0].logprobs))
