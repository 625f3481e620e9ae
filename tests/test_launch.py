"""The launcher end to end: training, metrics and alerts, resume, SIGTERM, step replay, bf16,
two processes over gloo, and clear errors for bad flags and configs."""
import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time

import jax
import numpy as np
import pytest

import moe_hk
from launch import capacity, model, trainer
from launch.configs import tiny
from launch.steps import make_steps
from metrics import traffic
from tests.test_metrics_tensorboard import read_images, read_scalars

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = "launch/configs/tiny.py"


def tiny_config(**overrides):
  c = tiny.get_config()
  c.update(overrides)
  return c


def launch(workdir, *flags, devices=8, env=None):
  """`python -m launch.train` on the tiny config as a subprocess (not waited for)."""
  env = dict(os.environ, **(env or {}),
             XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
  return subprocess.Popen(
      [sys.executable, "-m", "launch.train", f"--workdir={workdir}", f"--config={TINY}", *flags],
      cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_overflowing_run_trains_logs_alerts_records_and_checkpoints(tmp_path):
  """The untrained router of the tiny config needs buffer factors of 2.1-3.3: at 2.25 some
  steps fall back and some do not. The run writes every tag at every step, alerts where the
  traffic overflowed, records its traffic, and the planner replaying that traffic at 2.25
  predicts exactly the steps whose fallback ran."""
  c = tiny_config()
  c.moe.ragged_buffer_factor = 2.25
  losses = trainer.train_and_evaluate(c, str(tmp_path))
  assert len(losses) == 8 and all(np.isfinite(losses))
  assert np.mean(losses[-3:]) < np.mean(losses[:3]), losses
  scalars = read_scalars(str(tmp_path))
  for tag in ("train/loss", "train/learning_rate", "train/grad_norm", "train/tokens_per_second",
              "eval/loss", "moe/required_ragged_buffer_factor/layer_0", "moe/fallback_frequency",
              "moe/load_max_over_mean/layer_0", "moe/dead_experts/layer_0",
              "moe/router_entropy/layer_0", "moe/fallback_chunks/layer_0", "moe/lb_loss",
              "moe/z_loss", "moe/ragged_buffer_factor"):
    assert tag in scalars, tag
  for tag in ("train/loss", "moe/fallback_chunks/layer_0", "moe/router_entropy/layer_0"):
    assert sorted(scalars[tag]) == list(range(8)), tag  # every step, though fetched in batches
  np.testing.assert_allclose([scalars["train/loss"][s] for s in range(8)], losses, rtol=1e-6)
  fallbacks = [scalars["learning/moe_dropless_fallback_layers"][s] for s in range(8)]
  required = [scalars["moe/required_ragged_buffer_factor"][s] for s in range(8)]
  assert [f > 0 for f in fallbacks] == [r > 2.25 for r in required]
  assert 0 < sum(fallbacks) < 8, fallbacks  # the checks below can tell steps apart
  chunks = [scalars["moe/fallback_chunks/layer_0"][s] for s in range(8)]
  assert [n > 0 for n in chunks] == [f > 0 for f in fallbacks]
  assert all(v == 2.25 for v in scalars["moe/ragged_buffer_factor"].values())
  assert 0 < scalars["moe/router_entropy/layer_0"][0] <= np.log(8) + 1e-6
  assert scalars["moe/load_max_over_mean/layer_0"][0] >= 1.0
  images = read_images(str(tmp_path))["moe/expert_load"]
  # One per fetch: log_every=10 > 8 steps, so at the first checkpoint (step 1), at the eval
  # and checkpoint after step 4, and at the end.
  assert sorted(images) == [0, 3, 7]
  with open(tmp_path / "alerts.jsonl") as f:
    alerts = [json.loads(line) for line in f]
  assert {"fallback_ran", "frequent_fallback"} <= {a["rule"] for a in alerts}
  first = next(a for a in alerts if a["rule"] == "fallback_ran")
  assert first["step"] == fallbacks.index(1.0) and first["layers"] == [0]
  assert first["recommended_ragged_buffer_factor"] > 2.25
  # Raised from the layer's fallback event, it names where the traffic overflowed.
  [where] = first["hotspots"]
  assert where["layer"] == 0 and where["receivers"] and len(where["hot_experts"]) == 3
  assert set(where["receivers"]) <= set(range(8)) and set(where["hot_experts"]) <= set(range(8))
  assert "layer 0: expert shards" in first["message"]
  assert sorted(os.listdir(tmp_path / "checkpoints"))[-1] == "8"
  # The planner on the recorded traffic.
  recorded = traffic.read_traffic(str(tmp_path))
  assert list(recorded.steps) == list(range(8))
  [at_run] = capacity.plan(recorded, [2.25])
  assert at_run["fallback_frequency"] == pytest.approx(np.mean([f > 0 for f in fallbacks]))
  assert at_run["overflowing_layers_mean"] == pytest.approx(np.mean(fallbacks))


def _text_corpus(directory) -> str:
  """A few standard-library sources copied as text files; returns their glob."""
  os.makedirs(directory)
  for name in ("argparse.py", "ast.py", "dataclasses.py"):
    shutil.copy(os.path.join(sysconfig.get_paths()["stdlib"], name), directory)
  return os.path.join(str(directory), "*.py")


@pytest.mark.slow
def test_resumed_run_matches_uninterrupted_run(tmp_path):
  """Resuming from a checkpoint (not at a save interval) restores the train state, the grain
  iterator of a `files` corpus and the MoE metrics' trailing window: the losses and the
  window's figures equal the uninterrupted run's."""
  def config():
    c = tiny_config()
    c.data.source, c.data.pattern = "files", pattern
    return c
  pattern = _text_corpus(tmp_path / "corpus")
  straight = trainer.train_and_evaluate(config(), str(tmp_path / "straight"))
  first = trainer.train_and_evaluate(config(), str(tmp_path / "resumed"), stop_after=3)
  rest = trainer.train_and_evaluate(config(), str(tmp_path / "resumed"))
  assert len(first) == 3 and len(rest) == 5  # resumed from a step that is not a save interval
  np.testing.assert_allclose(first + rest, straight, rtol=1e-6)
  a, b = (read_scalars(str(tmp_path / run)) for run in ("straight", "resumed"))
  for tag in ("moe/fallback_frequency", "moe/recommended_ragged_buffer_factor"):
    assert sorted(b[tag]) == list(range(8)), tag
    np.testing.assert_allclose([b[tag][s] for s in range(8)], [a[tag][s] for s in range(8)],
                               rtol=1e-6, err_msg=tag)
  # The window is not trivially constant: the recommended factor moves as steps enter it.
  assert len({round(a["moe/recommended_ragged_buffer_factor"][s], 6) for s in range(8)}) > 1


@pytest.mark.slow
def test_step_replay_mode_matches_layer_fallback(tmp_path):
  """All-to-all path (the ring's is tested at the layer, tests/test_step_replay.py): the step
  that replays itself dropless when it overflowed, its state donated, gives the loss curve of
  the in-layer fallback (both are the dropless model), a step is replayed exactly when the
  layer run fell back at that step, and the capped model without a fallback ('none') differs."""
  def mode(name, **overrides):
    c = tiny_config(train_steps=4, **overrides)
    c.moe.moe_dropless_fallback = name
    return c
  layer = trainer.train_and_evaluate(mode("layer"), str(tmp_path / "layer"))
  replayed = trainer.train_and_evaluate(mode("step"), str(tmp_path / "step"))
  # The 'none' run also shows `moe_metrics=False`: training scalars only, nothing of the MoE's.
  capped = trainer.train_and_evaluate(mode("none", moe_metrics=False), str(tmp_path / "none"))
  quiet = read_scalars(str(tmp_path / "none"))
  np.testing.assert_allclose([quiet["train/loss"][s] for s in range(4)], capped, rtol=1e-6)
  assert not [t for t in quiet if t.startswith(("moe/", "learning/moe"))], sorted(quiet)
  assert not os.path.exists(tmp_path / "none" / "alerts.jsonl")
  np.testing.assert_allclose(replayed, layer, rtol=1e-5)
  assert np.max(np.abs(np.subtract(capped, layer))) > 1e-3
  fell_back = read_scalars(str(tmp_path / "layer"))["learning/moe_dropless_fallback_layers"]
  total = read_scalars(str(tmp_path / "step"))["moe/step_replays"]  # a running count
  per_step = np.diff([0] + [total[s] for s in range(4)])
  np.testing.assert_array_equal(per_step, [fell_back[s] > 0 for s in range(4)])
  assert per_step.sum() >= 1
  # One compiled step, its train state donated (no second copy of params and Adam state).
  config = mode("step")
  steps = make_steps(config, moe_hk.make_mesh(**config.mesh))
  state = steps.init(jax.random.key(0))
  batch = jax.device_put(np.zeros((config.data.batch_size, config.data.seq_len + 1), np.int32),
                         steps.batch_sharding)
  _, out = steps.train(state, batch)
  assert out["replayed"].dtype == bool
  assert all(leaf.is_deleted() for leaf in jax.tree.leaves(state))


@pytest.mark.slow
def test_bfloat16_compute_tracks_float32(tmp_path):
  """bf16 matmuls (params float32) follow the float32 loss curve within 2e-3 at every step
  (measured: within 4e-4 on both Pythons), and really compute in bf16 (the curves differ)."""
  f32 = trainer.train_and_evaluate(tiny_config(train_steps=6), str(tmp_path / "f32"))
  bf16 = trainer.train_and_evaluate(tiny_config(train_steps=6, dtype="bfloat16"),
                                    str(tmp_path / "bf16"))
  np.testing.assert_allclose(bf16, f32, rtol=2e-3)
  assert np.max(np.abs(np.subtract(bf16, f32))) > 0


@pytest.mark.slow
def test_sigterm_checkpoints_the_current_step_and_the_run_resumes(tmp_path):
  proc = launch(tmp_path, "--config.train_steps=1000", "--config.checkpoint_every=500")
  checkpoints = tmp_path / "checkpoints"
  deadline = time.time() + 240
  while not (checkpoints.exists() and os.listdir(checkpoints)) and time.time() < deadline:
    time.sleep(1)  # the first step's checkpoint: training is under way
  time.sleep(3)
  proc.send_signal(signal.SIGTERM)
  _, stderr = proc.communicate(timeout=120)
  assert proc.returncode == 0, stderr[-3000:]
  assert "SIGTERM: finishing the current step" in stderr
  saved = max(int(s) for s in os.listdir(checkpoints) if s.isdigit())
  assert 1 < saved < 1000
  scalars = read_scalars(str(tmp_path))
  assert sorted(scalars["train/loss"]) == list(range(saved))  # metrics flushed up to the stop
  # The resumed steps, and the steps before the stop, equal an uninterrupted run's.
  config = tiny_config(train_steps=1000, checkpoint_every=500)
  resumed = trainer.train_and_evaluate(config, str(tmp_path), stop_after=saved + 2)
  straight = trainer.train_and_evaluate(config, str(tmp_path / "straight"), stop_after=saved + 2)
  np.testing.assert_allclose(resumed, straight[saved:], rtol=1e-6)
  np.testing.assert_allclose([scalars["train/loss"][s] for s in range(saved)],
                             straight[:saved], rtol=1e-6)


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_over_gloo_match_one_process(tmp_path):
  """2 processes x 4 CPU devices on loopback (jax.distributed, gloo collectives) train the
  same 8-device mesh as one process and give the same losses."""
  port = _free_port()
  procs = [launch(tmp_path / "two", "--config.train_steps=3", f"--process_id={i}",
                  "--num_processes=2", f"--coordinator_address=127.0.0.1:{port}", devices=4)
           for i in range(2)]
  for p in procs:
    _, stderr = p.communicate(timeout=600)
    assert p.returncode == 0, stderr[-3000:]
  one = trainer.train_and_evaluate(tiny_config(train_steps=3), str(tmp_path / "one"))
  two = read_scalars(str(tmp_path / "two"))["train/loss"]
  np.testing.assert_allclose([two[s] for s in range(3)], one, rtol=1e-5)
  assert sorted(os.listdir(tmp_path / "two" / "checkpoints"))[-1] == "3"


@pytest.mark.parametrize("flag,message", [
    ("--config.moe.num_experts=12", "config.moe.num_experts=12 must be divisible by "
                                    "config.mesh.expert=8"),
    ("--config.moe.ragged_buffer_factor=0", "MoEConfig.ragged_buffer_factor=0.0 is invalid"),
    ("--config.data.batch_size=12", "config.data.batch_size=12 must be divisible by the 8"),
    ("--config.attention_block=5", "config.attention_block=5 must be 0 (whole sequence) or a "
                                   "divisor of config.data.seq_len=32"),
    ("--config.num_layers=3", "config.moe_every=2 must divide config.num_layers=3"),
    ("--config.moe.moe_dropless_fallback=always", "MoEConfig.moe_dropless_fallback='always' "
                                                  "is invalid: must be one of 'none', 'layer', "
                                                  "'step'"),
    ("--config.moe.dropless_fallback=layer", "--config.moe.dropless_fallback: no such config "
                                             "key (closest: config.moe.moe_dropless_fallback"),
    ("--config.moe.expert_axis=model", "config.moe.expert_axis='model' must be one of the "
                                       "mesh axes data, fsdp, expert"),
    ("--num_processes=2", "need --coordinator_address, --num_processes and --process_id"),
])
def test_bad_config_gives_a_short_clear_error(tmp_path, flag, message):
  proc = launch(tmp_path, flag)
  _, stderr = proc.communicate(timeout=300)
  assert proc.returncode != 0
  assert message in stderr
  assert "Traceback" not in stderr


def test_config_moe_keys_are_the_layer_fields():
  """One vocabulary: `config.moe` holds every settable `MoEConfig` field under its own name
  (plus the launcher's shared_expert), and the launcher builds the layer config from them."""
  c = tiny_config()
  fields = {f.name for f in dataclasses.fields(moe_hk.MoEConfig)}
  assert not fields & set(model.LAUNCHER_MOE_KEYS)
  assert set(c.moe) == fields - {"emb_dim", "dtype"} | set(model.LAUNCHER_MOE_KEYS)
  c.moe.gmm_impl, c.moe.gmm_block_rows, c.moe.a2a_impl = "ragged_dot", 16, "emulated"
  built = model.moe_config(c)
  assert (built.gmm_impl, built.gmm_block_rows, built.a2a_impl) == ("ragged_dot", 16, "emulated")
  assert (built.emb_dim, built.dtype) == (c.emb_dim, c.dtype)
  c.moe_metrics = False
  off = model.moe_config(c)
  assert not off.log_required_ragged_buffer_factor and not off.emit_fallback_events


def _autopilot_config(auto: bool, train_steps: int = 8):
  """The tiny config from factor 4.0, its worst case (min(P=8, E/K=4)): nothing can overflow,
  so after its 4-step window the autopilot can only lower the factor, whatever the router's
  numerics on this jax version; one candidate program at most (a compile costs more than this
  run), compiled while the step waits for it."""
  c = tiny_config(train_steps=train_steps, checkpoint_every=500)
  c.moe.ragged_buffer_factor = 4.0
  c.moe.autotune_ragged_buffer_factor = auto
  c.moe.update(target_fallback_frequency=0.3, autotune_window=4, autotune_max_programs=1,
               autotune_wait=True)
  return c


@pytest.mark.slow
def test_autopilot_lowers_the_factor_drops_nothing_and_resumes_with_it(tmp_path):
  """Switching factors changes the program, never the math: the loss curve equals the
  fixed-factor run's, nothing is dropped, the change is alerted, and a run resumed after the
  change continues with the lowered factor from its checkpoint."""
  fixed = trainer.train_and_evaluate(_autopilot_config(False), str(tmp_path / "fixed"))
  auto = str(tmp_path / "auto")
  first = trainer.train_and_evaluate(_autopilot_config(True), auto, stop_after=5)
  rest = trainer.train_and_evaluate(_autopilot_config(True), auto)
  np.testing.assert_allclose(first + rest, fixed, rtol=1e-5)
  scalars = read_scalars(auto)
  factors = [scalars["moe/ragged_buffer_factor"][s] for s in range(8)]
  assert factors[:4] == [4.0] * 4 and factors[4] < 4.0, factors
  assert factors[5:] == [factors[4]] * 3, factors  # the resumed run kept the checkpoint's
  assert all(scalars["moe/dropped_rows_fraction"][s] == 0 for s in range(8))
  with open(tmp_path / "auto" / "alerts.jsonl") as f:
    changes = [a for a in map(json.loads, f) if a["rule"] == "buffer_factor_changed"]
  assert [(c["step"], c["details"]["old_factor"], c["details"]["new_factor"])
          for c in changes] == [(4, 4.0, factors[4])]
  assert changes[0]["details"]["reason"] == "lower"


