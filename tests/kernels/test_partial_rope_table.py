import torch
from transformers import Qwen3Config, Qwen3NextConfig
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRotaryEmbedding

from vexact_models.kernels import apply_rotary
from vexact_models.layers import RopeTables


def test_rope_tables_of_a_partial_rotary_config_match_transformers():
    """Qwen3-Next / Qwen3.5's partial_rotary_factor 0.25 of head dim 256: the model's table holds the
    64 rotated dims' 32 frequencies, HF's cos/sin to fp32 rounding, and `apply_rotary` with it is
    HF's rotation of the first 64 dims."""
    config = Qwen3NextConfig(head_dim=256, hidden_size=64, num_attention_heads=2, num_key_value_heads=1,
                             max_position_embeddings=128,
                             rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})
    cos, sin = RopeTables(config, 256).get(torch.device("cpu"))
    assert cos.shape == sin.shape == (128, 32)
    hf = Qwen3NextRotaryEmbedding(config)
    positions = torch.arange(128)
    hf_cos, hf_sin = hf(torch.zeros(1, dtype=torch.float32), positions[None])
    assert torch.allclose(cos, hf_cos[0, :, :32], atol=1e-6) and torch.allclose(sin, hf_sin[0, :, :32], atol=1e-6)
    full = RopeTables(Qwen3Config(head_dim=256, hidden_size=64, num_attention_heads=2, num_key_value_heads=1), 256)
    assert full.get(torch.device("cpu"))[0].shape[-1] == 128  # no factor (Qwen3): the whole head
    x = torch.randn(5, 2, 256, dtype=torch.float64)
    out = apply_rotary(x, positions[:5], cos.double(), sin.double())
    c, s = hf_cos[0, :5, None].double(), hf_sin[0, :5, None].double()
    rot = torch.cat([-x[..., 32:64], x[..., :32]], -1)
    assert torch.allclose(out[..., :64], x[..., :64] * c + rot * s, atol=1e-6)
    assert torch.equal(out[..., 64:], x[..., 64:])
