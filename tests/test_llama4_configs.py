"""The shipped Llama 4 configs are the published architectures: every model key that
`launch.convert --from_hf` reads from Maverick's and Scout's published `config.json`
(`text_config`, as released with the checkpoints meta-llama/Llama-4-Maverick-17B-128E and
Llama-4-Scout-17B-16E) is what `launch/configs/maverick.py` and `scout.py` hold, so a run
trained from them computes what the published model computes.
"""
import pytest

from launch import settings as settings_lib
from launch.hf import hf_config, importing

# The fields of the published text configs that set the architecture (values as released).
_COMMON = {
    "model_type": "llama4_text", "hidden_size": 5120, "intermediate_size": 8192,
    "intermediate_size_mlp": 16384, "num_hidden_layers": 48, "num_attention_heads": 40,
    "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 202048, "hidden_act": "silu",
    "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "num_experts_per_tok": 1,
    "attention_chunk_size": 8192, "no_rope_layers": [], "attn_temperature_tuning": True,
    "floor_scale": 8192, "attn_scale": 0.1, "attention_bias": False,
    "tie_word_embeddings": False, "router_jitter_noise": 0.0,
}
PUBLISHED = {
    "maverick": dict(_COMMON, num_local_experts=128, interleave_moe_layer_step=2,
                     moe_layers=list(range(1, 48, 2)), use_qk_norm=False, rope_scaling=None),
    "scout": dict(_COMMON, num_local_experts=16, interleave_moe_layer_step=1,
                  moe_layers=list(range(48)), use_qk_norm=True,
                  rope_scaling={"rope_type": "llama3", "factor": 16.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 1.0,
                                "original_max_position_embeddings": 8192}),
}


def _shipped(name: str):
  return settings_lib.load(f"{settings_lib.CONFIGS}/{name}.py")


def _changed_by(keys: dict, config) -> set[str]:
  """The dotted `keys` whose value `config` does not already hold (set as `--from_hf` sets
  them)."""
  return {k for k, v in keys.items()
          if importing.configured(config, {k: v}).to_dict() != config.to_dict()}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_the_shipped_config_holds_every_key_the_published_one_converts_to(name):
  config = _shipped(name)
  keys = hf_config.model_keys(PUBLISHED[name])
  differ = {k: keys[k] for k in _changed_by(keys, config)}
  assert not differ, f"{name}.py is not the published architecture (published values): {differ}"
  settings_lib.build(config, 128)  # and the launcher takes it (Scout's equal llama3 factors)


def test_the_two_published_configs_differ_where_the_shipped_ones_do():
  """Control: the comparison sees a difference (Scout's keys are not Maverick's)."""
  assert _changed_by(hf_config.model_keys(PUBLISHED["scout"]), _shipped("maverick")) == {
      "moe_every", "qk_l2_norm", "rope_scaling.type", "rope_scaling.factor",
      "rope_scaling.high_freq_factor", "moe.num_experts"}
