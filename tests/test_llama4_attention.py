"""Llama 4's attention in the launcher's model against transformers' own, layer by layer:
interleaved rotary pairs, llama3 frequency scaling (`llama4_text_v4`), the weightless
query/key norm after the rotation, chunked attention on the RoPE layers and, on the NoPE layer,
the whole prefix with temperature-scaled queries. Transformers recorded each layer's attention
input and output (`attention.npz` beside each Llama 4 fixture,
tests/fixtures/hf/make_fixtures.py); the model's `attention` runs on that input with the
checkpoint's weights (float32, 1e-5). Controls: without the chunks, the rotary layers are off;
without the temperature, the NoPE layer is. The query/key norm's epsilon, too small in the
fixtures to show, is held to the config's at a larger one."""
import json
import os

import haiku as hk
import jax
import ml_collections
import numpy as np
import pytest
from safetensors.numpy import load_file

import moe_hk
from launch.configs import default
from launch.model import positions, transformer as model_lib
from tests.tree_close import assert_trees_close, relative_error

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "hf")


def _config(hf: dict) -> ml_collections.ConfigDict:
  """The launcher's keys for the attention of the fixture's config.json `hf`."""
  c = default.get_config()
  rope = hf.get("rope_parameters") or dict(hf.get("rope_scaling") or {},
                                           rope_theta=hf["rope_theta"])
  llama3 = rope.get("rope_type") == "llama3"
  c.update(num_heads=hf["num_attention_heads"], num_kv_heads=hf["num_key_value_heads"],
           head_dim=hf["head_dim"], rope_theta=rope["rope_theta"], rope_layout="interleaved",
           qk_l2_norm=hf["use_qk_norm"], norm_eps=hf["rms_norm_eps"],
           nope_every=hf["no_rope_layer_interval"],
           attention_chunk_size=hf["attention_chunk_size"],
           attn_temperature_tuning=hf["attn_temperature_tuning"],
           floor_scale=float(hf["floor_scale"]), attn_scale=hf["attn_scale"],
           attention_impl="xla")
  if llama3:
    c.rope_scaling.update(type="llama3", factor=rope["factor"],
                          low_freq_factor=rope["low_freq_factor"],
                          high_freq_factor=rope["high_freq_factor"],
                          original_max_positions=rope["original_max_position_embeddings"])
  return c


def _hf(folder: str) -> dict:
  """The fixture's text config (its config.json, or that file's `text_config`)."""
  with open(os.path.join(FIXTURES, folder, "config.json")) as f:
    hf = json.load(f)
  return hf.get("text_config", hf)


def _layer(folder: str, layer: int):
  """(transformers' attention input of `layer` in the fixture in `folder`, the checkpoint's
  weights of that layer as the model's `attention` parameters, transformers' output)."""
  recorded = np.load(os.path.join(FIXTURES, folder, "attention.npz"))
  tensors = load_file(os.path.join(FIXTURES, folder, "model.safetensors"))
  names = {n: next(k for k in tensors if k.endswith(f"layers.{layer}.self_attn.{n}_proj.weight"))
           for n in "qkvo"}
  params = {"~": {n: tensors[names[n]].T for n in "qkvo"}}
  return recorded[f"input_{layer}"], params, recorded[f"output_{layer}"]


def _forward(c: ml_collections.ConfigDict, rope: bool) -> hk.Transformed:
  return hk.without_apply_rng(hk.transform(
      lambda x_: model_lib.attention(x_, c, moe_hk.make_mesh(data=8), rope)))


def _attention(folder: str, layer: int, c: ml_collections.ConfigDict, rope: bool):
  """(the model's attention output, transformers') for `layer` of the fixture in `folder`."""
  x, params, expected = _layer(folder, layer)
  forward = _forward(c, rope)
  assert jax.tree.map(np.shape, params) == jax.tree.map(np.shape, forward.init(jax.random.key(0), x))
  return jax.jit(forward.apply)(params, x), expected


@pytest.mark.parametrize("folder", ["llama4_text", "llama4_text_v4", "llama4"])
def test_every_layers_attention_equals_transformers(folder):
  hf = _hf(folder)
  c = _config(hf)
  kinds = model_lib.block_kinds(c)
  for layer, use_rope in enumerate(hf["no_rope_layers"]):
    assert kinds[layer % len(kinds)][1] == bool(use_rope)
    y, expected = _attention(folder, layer, c, bool(use_rope))
    assert_trees_close(y, expected, what=f"{folder} layer {layer}")
  # Controls, each far above the 1e-5 the comparison allows.
  rotary_layer, nope_layer = 0, hf["no_rope_layers"].index(0)
  whole = c.copy_and_resolve_references()
  whole.update(attention_chunk_size=0, attn_temperature_tuning=False)
  for layer, rope in ((rotary_layer, True), (nope_layer, False)):
    y, expected = _attention(folder, layer, whole, rope)
    assert relative_error(y, expected) > 1e-3, (folder, layer)


def _l2_normed(t, eps: float) -> np.ndarray:
  """Each head of `t [..., head_dim]` over sqrt(its mean square + `eps`), in float64."""
  t = np.asarray(t, np.float64)
  return t / np.sqrt(np.mean(np.square(t), axis=-1, keepdims=True) + eps)


def test_the_query_key_norm_takes_the_configs_epsilon(monkeypatch):
  """Llama 4's weightless query/key norm divides each rotated head by sqrt(its mean square +
  norm_eps), the config's epsilon (transformers' Llama4TextL2Norm takes rms_norm_eps). The
  fixture's 1e-5 is too small beside its heads' mean squares (0.23 to 4.3) to show at
  float32's 1e-5, so norm_eps is 0.5 here: the queries and keys the attention kernel receives
  on a rotary layer equal the same layer's without the norm, normalised in numpy at 0.5;
  normalised at 1e-6 instead they are far off (the control)."""
  folder = "llama4_text_v4"
  hf = _hf(folder)
  assert hf["use_qk_norm"] and hf["no_rope_layers"][0]  # layer 0 rotates and normalises
  c = _config(hf)
  c.norm_eps = 0.5
  x, params, _ = _layer(folder, 0)
  received = []

  def kernel(q, k, v, **_):
    received.append((q, k))
    return q  # the heads' shape the output projection takes
  monkeypatch.setattr(model_lib.attention_lib, "causal_attention", kernel)
  for qk_l2_norm in (False, True):
    c.qk_l2_norm = qk_l2_norm
    _forward(c, rope=True).apply(params, x)
  raw, normed = received
  assert_trees_close(list(normed), [_l2_normed(t, 0.5) for t in raw], rtol=1e-5, what="q, k")
  off = [relative_error(a, _l2_normed(t, 1e-6)) for a, t in zip(normed, raw)]
  assert min(off) > 1e-2, off


def test_llama3_scaling_keeps_slows_and_blends_the_rates():
  """The three bands of Llama 3's frequency scaling on an 8-wide head (window 16 positions:
  wavelengths below 4 kept, above 16 slowed 8 times, between blended)."""
  scaling = ml_collections.ConfigDict(dict(type="llama3", factor=8.0, low_freq_factor=1.0,
                                           high_freq_factor=4.0, original_max_positions=16))
  plain = np.asarray(positions.frequencies(8, 500_000.0))
  scaled = np.asarray(positions.frequencies(8, 500_000.0, scaling))
  wavelength = 2 * np.pi / plain
  assert wavelength[0] < 16 < wavelength[1]  # one pair blended, three slowed
  np.testing.assert_allclose(scaled[1:], plain[1:] / 8, rtol=1e-6)
  blend = (16 / wavelength[0] - 1) / 3
  np.testing.assert_allclose(scaled[0], (1 - blend) * plain[0] / 8 + blend * plain[0],
                             rtol=1e-6)


def test_llama3_scaling_with_equal_factors_slows_or_keeps():
  """Scout's published factors (low = high = 1): no blended band, so a pair is slowed when its
  wavelength exceeds the window and kept otherwise, with nothing divided by zero."""
  scaling = ml_collections.ConfigDict(dict(type="llama3", factor=16.0, low_freq_factor=1.0,
                                           high_freq_factor=1.0, original_max_positions=16))
  plain = np.asarray(positions.frequencies(8, 500_000.0))
  scaled = np.asarray(positions.frequencies(8, 500_000.0, scaling))
  slowed = 2 * np.pi / plain > 16
  assert slowed.any() and not slowed.all()
  np.testing.assert_array_equal(scaled, np.where(slowed, plain / 16, plain))
