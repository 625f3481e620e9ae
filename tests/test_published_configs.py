"""`launch.convert --from_hf` takes the config.json files their authors published (copies in
tests/fixtures/hf/published, every field; its README.md says where each came from): each field
is read by the converter or known not to change the model (`hf_config.BOOKKEEPING`). A field
that does change the model is still refused, in one line naming it.
"""
import os
import re

import pytest

from launch.hf import hf_config
from launch.setup.errors import UserError
from tests.helpers import PUBLISHED, published

# Maverick's FP8 release: its weights are quantized, which the converter refuses.
QUANTIZED = "llama4_maverick_17b_128e_instruct_fp8"
CONVERTED = sorted(name[:-len(".json")] for name in os.listdir(PUBLISHED)
                   if name.endswith(".json") and name != f"{QUANTIZED}.json")


def _refusal(hf: dict) -> str:
  """The converter's refusal of `hf`, checked to be one line."""
  with pytest.raises(UserError) as error:
    hf_config.model_keys(hf)
  assert "\n" not in str(error.value)
  return str(error.value)


def test_the_published_files_are_there():
  """Control: the parametrized tests below see every family's files."""
  assert CONVERTED == ["llama4_scout_17b_16e_instruct", "mixtral_8x22b_v0.1",
                       "mixtral_8x7b_v0.1", "qwen3_235b_a22b", "qwen3_30b_a3b"]


@pytest.mark.parametrize("name", CONVERTED)
def test_every_field_of_a_published_config_is_read_or_bookkeeping(name):
  hf = published(name)
  keys = hf_config.model_keys(hf)
  assert keys["num_layers"] == hf_config.text_config(hf)["num_hidden_layers"]
  assert hf_config.semantics(keys, hf_config.family_of(hf))


def test_the_quantized_release_is_refused_naming_its_quantization():
  """Its language model's config converts (tests/test_llama4_configs.py); its FP8 weights do
  not, and the refusal's value is cut short, not the whole scheme."""
  message = _refusal(published(QUANTIZED))
  assert message.startswith("config.json quantization_config={") and len(message) < 300


@pytest.mark.parametrize("name, field, value, named", [
    ("llama4_scout_17b_16e_instruct", "attn_logit_softcapping", 30.0,
     "attn_logit_softcapping=30.0: a field launch.convert does not know"),
    ("llama4_scout_17b_16e_instruct", "rope_scaling",
     {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 8192},
     "rope_scaling=.*implemented: none or llama3"),
    ("llama4_scout_17b_16e_instruct", "nope_layer_interval", 2,
     "nope_layer_interval=2: implemented: the interval no_rope_layer_interval gives"),
    ("mixtral_8x7b_v0.1", "attn_logit_softcapping", 30.0,
     "attn_logit_softcapping=30.0: a field launch.convert does not know"),
    ("qwen3_30b_a3b", "rope_scaling", {"rope_type": "yarn", "factor": 4.0},
     "rope_scaling=.*implemented: null"),
])
def test_a_field_that_changes_the_model_is_refused(name, field, value, named):
  """A made-up field, another RoPE scaling, a NoPE interval transformers would not use: in the
  language model's config (Llama 4's text_config), in one line naming it."""
  hf = published(name)
  if "text_config" in hf:
    hf["text_config"][field] = value
  else:
    hf[field] = value
  assert re.match("config.json " + named, _refusal(hf))


def test_a_made_up_field_beside_the_text_config_is_refused():
  """The multimodal config's own fields are checked too (the vision tower's are known)."""
  hf = dict(published("llama4_scout_17b_16e_instruct"), projector_bias_scale=2.0)
  assert "projector_bias_scale=2.0: a field launch.convert does not know" in _refusal(hf)
