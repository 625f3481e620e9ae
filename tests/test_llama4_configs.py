"""The shipped Llama 4 configs are the published architectures: the model keys that
`launch.convert --from_hf` reads from Scout's and Maverick's published config.json files
(tests/fixtures/hf/published, every field as released; its README.md says where each came from)
are what `launch/configs/scout.py` and `maverick.py` hold, so a run trained from them computes
what the published model computes.

The Scout file found whole is the first release's, with a RoPE scaling of factor 8 and high
frequency factor 4; scout.py holds the factor 16 and high frequency factor 1 of the later file
(the base model's, as quoted in AMD-AGI/Primus pull request 165, August 2025). The Maverick
file found whole is the FP8 release, whose language model's config is compared (its quantized
weights are refused: tests/test_published_configs.py).
"""
import pytest

from launch.hf import hf_config, importing
from launch.setup import settings as settings_lib
from tests.helpers import published

# The first Scout release's RoPE scaling, the keys it gives that scout.py does not hold.
_FIRST_SCOUT_ROPE = {"rope_scaling.factor": 8.0, "rope_scaling.high_freq_factor": 4.0}


def _shipped(name: str):
  return settings_lib.load(f"{settings_lib.CONFIGS}/{name}.py")


def _published_keys(name: str) -> dict:
  """The model keys of the published config of `name` ('scout' or 'maverick'); Maverick's
  without its FP8 quantization (the language model's config as released)."""
  if name == "scout":
    return hf_config.model_keys(published("llama4_scout_17b_16e_instruct"))
  hf = published("llama4_maverick_17b_128e_instruct_fp8")
  del hf["quantization_config"]
  return hf_config.model_keys(hf)


def _changed_by(keys: dict, config) -> dict:
  """The dotted `keys` whose value `config` does not already hold (set as `--from_hf` sets
  them), with the published value."""
  return {k: v for k, v in keys.items()
          if importing.configured(config, {k: v}).to_dict() != config.to_dict()}


@pytest.mark.parametrize("name, differ", [("maverick", {}), ("scout", _FIRST_SCOUT_ROPE)])
def test_the_shipped_config_holds_every_key_the_published_one_converts_to(name, differ):
  config = _shipped(name)
  assert _changed_by(_published_keys(name), config) == differ, (
      f"{name}.py is not the published architecture")
  settings_lib.build(config, 128)  # and the launcher takes it (Scout's equal llama3 factors)


def test_the_two_published_configs_differ_where_the_shipped_ones_do():
  """Control: the comparison sees a difference (Scout's keys are not Maverick's)."""
  assert set(_changed_by(_published_keys("scout"), _shipped("maverick"))) == {
      "moe_every", "qk_l2_norm", "rope_scaling.type", "moe.num_experts"}
