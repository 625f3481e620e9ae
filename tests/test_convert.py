"""Public checkpoints in and out (`launch.convert`, `launch.score`), against transformers.

The fixtures (tests/fixtures/hf, made by its make_fixtures.py with transformers and torch,
which the suite does not need) are tiny random `MixtralForCausalLM`, `Qwen3MoeForCausalLM`,
`Llama4ForCausalLM` (two layer patterns) and `Llama4ForConditionalGeneration` checkpoints as
`save_pretrained` wrote them, with the float32 logits transformers computed for fixed ids. Each family is imported once (module fixture); its logits, export and fine-tune
reuse that run and one compiled forward per configuration.
"""
import json
import os
import re
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors import safe_open

import moe_hk
from launch.checkpoints import parameters, store
from launch.hf import exporting, hf_config, importing, reading, writing
from launch.model import scoring, train_step as steps_lib
from launch.run import trainer
from launch.setup import settings as settings_lib
from launch.setup.errors import UserError
from moe_hk import routing
from tests.helpers import ROOT, cached_make_steps, run_module, settings_of, tiny_config

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "hf")
FAMILIES = ("mixtral", "qwen3_moe")
# Llama 4: Maverick's layer pattern, Scout's (its config in the transformers-4 style) and the
# multimodal checkpoint's language model.
LLAMA4 = ("llama4_text", "llama4_text_v4", "llama4")
MULTIMODAL_PREFIX = "language_model."
# The fine-tune tests' steps, compiled once: the direct steps and launch.train's share them.
_STEPS = cached_make_steps(steps_lib.make_steps)


def _fixture(family: str, name: str) -> np.ndarray:
  return np.load(os.path.join(FIXTURES, family, name))


def _relative(a: np.ndarray, b: np.ndarray) -> float:
  """max |a - b| / max |b|."""
  return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def _tensors(folder: str) -> dict[str, np.ndarray]:
  """Every tensor of a Hugging Face checkpoint folder, by name."""
  with reading.SafetensorsFolder(folder) as source:
    return {name: source.slice(name)[:] for name in source.files}


def _text_tensors(family: str) -> dict[str, np.ndarray]:
  """The fixture's language-model tensors, as a text checkpoint names them (the multimodal
  one's without their prefix, its vision tower left out)."""
  tensors = _tensors(os.path.join(FIXTURES, family))
  if family != "llama4":
    return tensors
  return {n[len(MULTIMODAL_PREFIX):]: a for n, a in tensors.items()
          if n.startswith(MULTIMODAL_PREFIX)}


@pytest.fixture(scope="module", params=FAMILIES + LLAMA4)
def imported(request, tmp_path_factory):
  """(family, workdir, settings) of the family's fixture imported with the tiny config: a
  capped buffer (factor 1) that the skewed routers overflow, the fallback on."""
  workdir = str(tmp_path_factory.mktemp(request.param))
  config = tiny_config(data=dict(tiny_config().data, batch_size=8, seq_len=15))
  importing.import_checkpoint(os.path.join(FIXTURES, request.param), workdir, config)
  return request.param, workdir, settings_of(settings_lib.saved(workdir))


def _logits(run_settings, params, ids):
  mesh = moe_hk.make_mesh(**run_settings.mesh)
  logits, stats = scoring.forward(run_settings, mesh)(params, ids)
  return np.asarray(logits), np.asarray(stats.fallback)


def test_logits_equal_transformers_with_the_fallback(imported):
  """The capped buffer overflows in every layer and the fallback makes the model dropless:
  moe-hk's logits are transformers' within 1e-4 relative; capped without the fallback, the
  dropped rows move them far past it."""
  family, workdir, run_settings = imported
  _, params = parameters.restore_params(run_settings, workdir)
  ids, want = _fixture(family, "input_ids.npy"), _fixture(family, "logits.npy")
  logits, fell_back = _logits(run_settings, params, ids)
  print(f"{family}: max relative logit difference {_relative(logits, want):.2e}")
  assert fell_back.all(), f"{family}: the capped buffer did not overflow ({fell_back})"
  assert _relative(logits, want) <= 1e-4
  dropping = run_settings._replace(layer=run_settings.layer.replace(moe_dropless_fallback="none"))
  assert _relative(_logits(dropping, params, ids)[0], want) > 1e-2


@pytest.mark.parametrize("imported", FAMILIES + ("llama4_text_v4", "llama4"), indirect=True)
def test_export_writes_the_fixture_and_imports_back_exactly(imported, tmp_path):
  """--to_hf writes the fixture's tensor names, shapes and values (Llama 4's experts fused
  again; a multimodal checkpoint's language model as a text checkpoint) and a config
  transformers 4 and 5 read alike; importing that folder gives back every parameter bit for
  bit."""
  family, workdir, run_settings = imported
  exporting.export_run(workdir, str(tmp_path / "out"), None, 1 << 30)
  want, got = _text_tensors(family), _tensors(str(tmp_path / "out"))
  assert sorted(got) == sorted(want)
  for name, array in want.items():
    np.testing.assert_array_equal(got[name], array, err_msg=name)
  assert os.path.isfile(tmp_path / "out" / "tokenizer.json")  # kept by the run, exported
  exported = json.load(open(tmp_path / "out" / "config.json"))
  assert exported["rope_theta"] == exported["rope_parameters"]["rope_theta"] == 500_000.0
  rope_type = exported["rope_parameters"]["rope_type"]
  assert rope_type == ("llama3" if family == "llama4_text_v4" else "default")
  assert (exported["rope_scaling"] or {}).get("rope_type", "default") == rope_type
  again = str(tmp_path / "again")
  importing.import_checkpoint(str(tmp_path / "out"), again, run_settings.config)
  first = parameters.restore_params(run_settings, workdir)[1]
  second = parameters.restore_params(settings_of(settings_lib.saved(again)), again)[1]
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(first), jax.device_get(second))


@pytest.mark.parametrize("imported", FAMILIES, indirect=True)
def test_export_shards_and_keeps_the_dtype(imported, tmp_path):
  """Past the size limit the weights split into files with an index; a bfloat16 checkpoint
  (that one) imports through its index and exports bfloat16 again."""
  family, workdir, run_settings = imported
  _, params = parameters.restore_params(run_settings, workdir)
  hf = json.load(open(os.path.join(FIXTURES, family, "config.json")))
  files = writing.write(str(tmp_path / "bf16"), writing.hf_tensors(
      params, hf_config.family_of(hf).tensors(hf_config.model_keys(hf)), "bfloat16"),
      max_bytes=64 << 10)
  assert len(files) > 2 and os.path.isfile(tmp_path / "bf16" / "model.safetensors.index.json")
  shutil.copy(os.path.join(FIXTURES, family, "config.json"), tmp_path / "bf16")
  importing.import_checkpoint(str(tmp_path / "bf16"), str(tmp_path / "run"), run_settings.config)
  exporting.export_run(str(tmp_path / "run"), str(tmp_path / "out"), None, 1 << 30)
  with safe_open(str(tmp_path / "out" / "model.safetensors"), "numpy") as f:
    assert {f.get_slice(name).get_dtype() for name in f.keys()} == {"BF16"}
  want = _tensors(os.path.join(FIXTURES, family))
  got = _tensors(str(tmp_path / "out"))
  for name, array in want.items():
    np.testing.assert_array_equal(got[name], array.astype(got[name].dtype), err_msg=name)


# The train-step tests run Qwen3-MoE and Llama 4 (Maverick's pattern: dense and MoE layers,
# NoPE): a train step's compile is their cost, and the logits tests cover every family's
# forward.
ONE_FAMILY = pytest.mark.parametrize("imported", ["qwen3_moe", "llama4_text"], indirect=True)


@ONE_FAMILY
def test_finetune_starts_at_transformers_loss(imported):
  """The trainer's checkpoint 0 of an import, trained on the fixture's ids: the first loss is
  the cross-entropy of transformers' logits on that batch, and later steps learn."""
  family, workdir, run_settings = imported
  mesh = moe_hk.make_mesh(**run_settings.mesh)
  steps = _STEPS(run_settings, mesh)
  saver = store.Checkpoints(workdir, keep=3, every=1)
  state = saver.restore(steps_lib.abstract_inputs(run_settings.config, steps)[0]).state
  saver.close()
  ids, logits = _fixture(family, "input_ids.npy"), _fixture(family, "logits.npy")
  want = float(np.mean(scoring.token_losses(logits, ids)))
  batch = jax.device_put(ids, steps.batch_sharding)
  losses = []
  for _ in range(4):
    state, out = steps.train(state, batch)
    losses.append(float(out.loss))
  assert losses[0] == pytest.approx(want, rel=1e-5)
  assert losses[-1] < losses[0]


@ONE_FAMILY
def test_launch_train_continues_the_import(imported, tmp_path, monkeypatch, capsys):
  """The trainer resumes the import's checkpoint 0 (its data, metrics and autopilot state
  included) with the run's recorded config, trains and checkpoints."""
  _, workdir, _ = imported
  run = str(tmp_path / "run")
  shutil.copytree(workdir, run)
  monkeypatch.setattr(trainer, "make_steps", _STEPS)
  config = settings_lib.saved(run)
  losses = trainer.train_and_evaluate(settings_of(config), run, stop_after=2)
  assert "/checkpoints/0: the next step is 0" in capsys.readouterr().out
  assert len(losses) == 2 and np.all(np.isfinite(losses))
  assert store.newest_step(run) == 2


@pytest.mark.slow
@pytest.mark.parametrize("imported", FAMILIES + ("llama4_text_v4",), indirect=True)
def test_score_command(imported, tmp_path):
  """`launch.score` as users run it: Mixtral's --input_ids logits are transformers' (1e-4);
  Qwen3-MoE's and Llama 4's --text goes through the run's tokenizer.json, a loss per next token
  and their mean and perplexity. Llama 4's top-1 over 8 expert shards has no fallback chunk
  that fits 4 tokens a sequence at factor 1: it scores with the worst-case buffer and says so."""
  family, workdir, _ = imported
  if family == "mixtral":
    out = run_module(["launch.score", f"--workdir={workdir}", f"--output={tmp_path}/l.npy",
                      f"--input_ids={FIXTURES}/{family}/input_ids.npy"])
    assert "the dropless fallback ran in 2 of 2 MoE layers" in out
    assert _relative(np.load(tmp_path / "l.npy"), _fixture(family, "logits.npy")) <= 1e-4
    return
  lines = run_module(["launch.score", f"--workdir={workdir}", "--text=w5 w17 w200 w3"]
                     ).strip().splitlines()
  assert ("scored with the worst-case buffer" in lines[0]) == (family == "llama4_text_v4")
  losses = [float(line.split("\t")[1]) for line in lines[1:-1]]
  assert [line.split("\t")[0] for line in lines[1:-1]] == ["'w17'", "'w200'", "'w3'"]
  words = lines[-1].split()  # 3 tokens: mean loss M nats, perplexity P
  assert words[:2] == ["3", "tokens:"] and float(words[4]) == pytest.approx(np.mean(losses),
                                                                           abs=1e-4)
  assert float(words[-1]) == pytest.approx(np.exp(float(words[4])), rel=1e-3)


@pytest.mark.parametrize("field, value, named", [
    ("sliding_window", 4096, "sliding_window=4096"),
    ("rope_scaling", {"type": "yarn", "factor": 4.0}, "rope_scaling="),
    ("model_type", "deepseek_v3", "model_type=\"deepseek_v3\""),
    ("tie_word_embeddings", True, "tie_word_embeddings=true"),
    ("attn_logit_softcapping", 50.0, "attn_logit_softcapping=50.0"),
    ("num_experts", 16, "num_experts="),
    ("rope_theta", 10_000.0, "rope_theta="),
    ("rms_norm_eps", None, "rms_norm_eps=null"),
])
def test_refuses_what_the_model_does_not_implement(field, value, named):
  """Each unsupported field is one line naming it and its value (the expert count and the
  RoPE base where two places disagree: transformers 4 and 5 would read different models)."""
  hf = json.load(open(os.path.join(FIXTURES, "mixtral", "config.json")))
  hf[field] = value
  with pytest.raises(UserError, match="config.json " + named.replace("[", r"\[")) as error:
    hf_config.model_keys(hf)
  assert "\n" not in str(error.value)


@pytest.mark.parametrize("field, value, named", [
    ("moe_layers", [0, 3], "moe_layers=[0, 3]: implemented: every k-th layer MoE"),
    ("no_rope_layers", [1, 0, 1, 1], "no_rope_layers=[1, 0, 1, 1]: implemented: every n-th"),
    ("rope_parameters", {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0},
     "rope_scaling=.*implemented: none or llama3"),
    ("tie_word_embeddings", True, "tie_word_embeddings=true"),
    ("attn_logit_softcapping", 50.0, "attn_logit_softcapping=50.0"),
])
def test_refuses_a_llama4_the_model_does_not_implement(field, value, named):
  """Llama 4's own layouts beyond the model: a layer pattern not every k-th / n-th, another
  RoPE scaling; in one line, in the text config and inside a multimodal one alike."""
  text = json.load(open(os.path.join(FIXTURES, "llama4_text", "config.json")))
  multimodal = json.load(open(os.path.join(FIXTURES, "llama4", "config.json")))
  for hf in (dict(text, **{field: value}),
             dict(multimodal, text_config=dict(multimodal["text_config"], **{field: value}))):
    with pytest.raises(UserError, match="config.json " + named.replace("[", r"\[")) as error:
      hf_config.model_keys(hf)
    assert "\n" not in str(error.value)


def test_convert_refuses_in_one_line(tmp_path):
  """The command's refusal: exit status 1, one line on stderr, nothing written."""
  folder = tmp_path / "hf"
  shutil.copytree(os.path.join(FIXTURES, "qwen3_moe"), folder)
  hf = json.load(open(folder / "config.json"))
  json.dump(dict(hf, use_sliding_window=True, sliding_window=4096), open(folder / "config.json",
                                                                         "w"))
  done = subprocess.run([sys.executable, "-m", "launch.convert", f"--from_hf={folder}",
                         f"--workdir={tmp_path / 'run'}"], cwd=ROOT, capture_output=True,
                        text=True, check=False)
  assert done.returncode == 1, done.stderr
  assert done.stderr.strip().count("\n") == 0 and "use_sliding_window=true" in done.stderr
  assert not os.path.exists(tmp_path / "run" / "checkpoints")


def test_reads_transformers_4_and_5_configs_alike():
  """The RoPE base top-level (transformers 4) or in rope_parameters (5), the expert count as
  num_experts (published Qwen3-MoE) or num_local_experts (transformers 5): the same model."""
  hf = json.load(open(os.path.join(FIXTURES, "qwen3_moe", "config.json")))
  old = {k: v for k, v in hf.items() if k not in ("rope_parameters", "num_local_experts")}
  old.update(rope_theta=500_000.0, num_experts=8)
  assert hf_config.model_keys(old) == hf_config.model_keys(hf)
  assert hf_config.model_keys(hf)["rope_theta"] == 500_000.0
  assert hf_config.model_keys(hf)["moe.num_experts"] == 8


@pytest.mark.parametrize("key, value, valid", [("rope_theta", 0.0, "> 0"),
                                              ("norm_eps", 0.0, "in (0, 1)")])
def test_model_knobs_are_checked(key, value, valid):
  """The model's new keys refuse what they cannot mean, in one line naming the key."""
  with pytest.raises(UserError, match=rf"config.{key}={value} must be {re.escape(valid)}"):
    settings_of(tiny_config(**{key: value}))


def test_unnormalised_top_k_weights_are_the_full_softmax():
  """`norm_topk_prob=False`: each chosen expert weighs its probability under the softmax over
  all E logits (numpy reference); True: the chosen probabilities renormalised."""
  x = np.random.default_rng(0).normal(size=(6, 4)).astype(np.float32)
  w = np.random.default_rng(1).normal(size=(4, 5)).astype(np.float32)
  logits = x @ w
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  top = np.argsort(-logits, axis=-1)[:, :2]
  chosen = np.take_along_axis(probs, top, -1)
  for norm, want in ((False, chosen), (True, chosen / chosen.sum(-1, keepdims=True))):
    route = routing.route(jnp.asarray(x), jnp.asarray(w), 2, "softmax", norm)
    np.testing.assert_array_equal(np.asarray(route.expert_ids), top)
    np.testing.assert_allclose(np.asarray(route.weights), want, rtol=1e-6)
  with pytest.raises(ValueError, match="norm_topk_prob=False"):
    moe_hk.MoEConfig(8, 1, 16, 32, router_score="sigmoid", norm_topk_prob=False)
