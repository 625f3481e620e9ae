"""The launcher end to end: training, metrics and alerts, resume, SIGTERM, step mode, bf16,
two processes over gloo, and clear errors for bad flags and configs."""
import contextlib
import dataclasses
import glob
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import threading
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

import moe_hk
from launch.checkpoints import run_config as run_config_lib
from launch.data import loader as data_lib
from launch.model import spikes as spikes_lib
from launch.model.train_step import abstract_inputs
from launch.planning import replay
from launch.run import reporter as reporter_lib, stop_request, trainer
from launch.setup import settings as settings_lib
from launch.setup.errors import UserError
from metrics import expert_load, tags, traffic
from metrics.event_files import read_histograms, read_images, read_scalars
from tests.helpers import (ROOT, TINY, TINY_FLAGS, cached_make_steps, child_xla_flags,
                           free_port, settings_of, tiny_config, unavailable)

# Every test here shares one worker's step cache and the baseline run (tests/conftest.py
# WORKER_GROUPS).

# The untrained router of the tiny config needs buffer factors of 2.7-3.8: at 3.125 some steps
# fall back and some do not. The float32 baseline every comparison below is made against.
FACTOR = 3.125
RECOMMENDED = "moe/recommended_ragged_buffer_factor"


@pytest.fixture(autouse=True)
def shared_steps(monkeypatch):
  """Runs of one config reuse its compiled steps (as one long run would): the trainer's
  `make_steps` memoised for the whole module."""
  monkeypatch.setattr(trainer, "make_steps", _STEPS)


_STEPS = cached_make_steps(trainer.make_steps)


def run_config(**overrides):
  """The tiny config at FACTOR with the 'layer' fallback, the factor rule named from 2 steps
  of evidence on (8-step runs); top-level fields replaced."""
  c = tiny_config(**overrides)
  c.moe.ragged_buffer_factor = FACTOR
  c.moe.moe_dropless_fallback = "layer"
  c.autopilot.min_steps = 2
  return c


class Baseline(NamedTuple):
  workdir: str
  losses: list[float]
  console: str  # what the run printed


@pytest.fixture(scope="module")
def baseline(tmp_path_factory) -> Baseline:
  """The 8-step float32 run of `run_config()`."""
  workdir = str(tmp_path_factory.mktemp("baseline"))
  printed = io.StringIO()
  with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(printed):
    patch.setattr(trainer, "make_steps", _STEPS)
    losses = trainer.train_and_evaluate(settings_of(run_config()), workdir)
  return Baseline(workdir, losses, printed.getvalue())


def _restored_state(settings, workdir, step=None):
  """Checkpoint `step`'s train state in `workdir` (the newest: None), on the host."""
  steps = _STEPS(settings, moe_hk.make_mesh(**settings.mesh))
  abstract = abstract_inputs(settings.config, steps)[0]
  manager = ocp.CheckpointManager(os.path.join(workdir, "checkpoints"))
  try:
    step = manager.latest_step() if step is None else step
    return jax.device_get(manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract))).state)
  finally:
    manager.close()


def launch(workdir, *flags, devices=8, env=None, config=TINY, llvm_level=None):
  """`python -m launch.train` on `config` (the tests' tiny config by default) with the tests'
  grouped matmul as a subprocess (not waited for). `llvm_level` replaces the suite's LLVM
  optimisation of the child's CPU code (0, the quickest compile: tests/conftest.py); 1 suits a
  run whose steps outweigh its compile (the default job's: 20 steps 1.43 -> 0.68 s each, its
  compile 6.4 -> 9.5 s)."""
  llvm = {} if llvm_level is None else {"xla_backend_optimization_level": llvm_level}
  env = dict(os.environ, **(env or {}), XLA_FLAGS=child_xla_flags(
      xla_force_host_platform_device_count=devices, **llvm))
  return subprocess.Popen(
      [sys.executable, "-m", "launch.train", f"--workdir={workdir}", f"--config={config}",
       *TINY_FLAGS, *flags],
      cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _assert_tensorboard_reads_at_a_glance(workdir: str, heatmap: np.ndarray, scalars) -> None:
  """What TensorBoard shows of the run (`tensorboard --logdir WORKDIR`): one run folder named
  after the workdir; the CUSTOM SCALARS layout's first chart draws the buffer factor from three
  runs (TensorBoard colours lines by run), each named for its series and holding the step's
  values; the fallback layers on a chart of their own; a description on every MoE tag; the
  expert-load heatmap drawn at its width with a colour bar (its levels in one column)."""
  import matplotlib
  from tensorboard.backend.event_processing import plugin_event_multiplexer
  from tensorboard.plugins.custom_scalar import layout_pb2
  name = os.path.basename(workdir)
  multiplexer = plugin_event_multiplexer.EventMultiplexer()
  multiplexer.AddRunsFromDirectory(workdir)
  multiplexer.Reload()
  factor_runs = [f"{name}/{series}" for series in tags.FACTOR_SERIES]
  assert sorted(multiplexer.Runs()) == sorted([name, *factor_runs])
  [layout] = multiplexer.Tensors(name, "custom_scalars__config__")
  charts = layout_pb2.Layout.FromString(layout.tensor_proto.string_val[0]).category[0].chart
  assert list(charts[0].multiline.tag) == [f"^{tags.FACTOR_SERIES_TAG}$"]
  assert [list(c.multiline.tag) for c in charts[1:3]] == [
      [f"^{tags.FREQUENCY_TAG}$"], [f"^{tags.FALLBACK_LAYERS_TAG}$"]]
  for run, source in zip(factor_runs, tags.FACTOR_SERIES.values()):
    series = read_scalars(os.path.join(workdir, run))[tags.FACTOR_SERIES_TAG]
    assert series == scalars[source], run
  moe_tags = [t for t in multiplexer.GetAccumulator(name).Tags()["tensors"]
              if t.startswith("moe/") or t == tags.FALLBACK_LAYERS_TAG]
  undescribed = [t for t in moe_tags
                 if not multiplexer.SummaryMetadata(name, t).summary_description]
  assert {tags.EXPERT_LOAD_TAG, f"{tags.TOKENS_PER_EXPERT_TAG}/layer_0", tags.FALLBACK_LAYERS_TAG,
          tags.FACTOR_IN_FORCE_TAG, tags.RECOMMENDED_FACTOR_TAG} <= set(moe_tags), moe_tags
  assert not undescribed, undescribed
  assert heatmap.shape[1] == expert_load.WIDTH_PIXELS and heatmap.shape[2] >= 3
  lut = np.asarray(matplotlib.colormaps[expert_load.COLORMAP](np.arange(256), bytes=True))
  bar = max(len({int(i) for i, d in zip(*(lambda dist: (dist.argmin(1), dist.min(1)))(
      np.abs(heatmap[:, x, None, :3].astype(int) - lut[None, :, :3].astype(int)).sum(-1)))
      if d <= 6}) for x in range(heatmap.shape[1]))
  assert bar > 100, bar


@pytest.mark.slow
def test_overflowing_run_trains_logs_alerts_records_and_checkpoints(baseline):
  """At FACTOR some steps fall back and some do not. The run writes every tag at every step,
  alerts where the traffic overflowed, records its traffic, and the planner replaying that
  traffic at FACTOR predicts exactly the steps whose fallback ran."""
  workdir, losses, _ = baseline
  assert len(losses) == 8 and all(np.isfinite(losses))
  assert np.mean(losses[-3:]) < np.mean(losses[:3]), losses
  scalars = read_scalars(workdir)
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
  assert [f > 0 for f in fallbacks] == [r > FACTOR for r in required]
  assert 0 < sum(fallbacks) < 8, fallbacks  # the checks below can tell steps apart
  chunks = [scalars["moe/fallback_chunks/layer_0"][s] for s in range(8)]
  assert [n > 0 for n in chunks] == [f > 0 for f in fallbacks]
  assert all(v == FACTOR for v in scalars["moe/ragged_buffer_factor"].values())
  # The load tags of every step equal what the recorded traffic (another route from the same
  # stats) says of that step's rows per expert.
  recorded = traffic.read_traffic(workdir)
  assert list(recorded.steps) == list(range(8))
  for layer in range(recorded.counts.shape[1]):
    per_expert = recorded.counts[:, layer].sum(axis=1)  # [steps, E]
    np.testing.assert_allclose(
        [scalars[f"moe/load_max_over_mean/layer_{layer}"][s] for s in range(8)],
        per_expert.max(axis=1) / per_expert.mean(axis=1), rtol=1e-6)
    np.testing.assert_array_equal(
        [scalars[f"moe/dead_experts/layer_{layer}"][s] for s in range(8)],
        (per_expert == 0).sum(axis=1))
    buckets = read_histograms(workdir)[f"moe/tokens_per_expert/layer_{layer}"]
    np.testing.assert_array_equal([buckets[s][-1, 1] for s in range(8)], per_expert.max(axis=1))
  # An untrained router is undecided over 8 experts: its entropy is below log 8 and within a
  # nat of it (1.5-1.8 here: the router's input is mostly the blocks' outputs, alike across
  # tokens), where a sign error is negative, base 2 up to 3 and a missing normalisation far
  # above; and it moves as the router trains.
  entropy = [scalars["moe/router_entropy/layer_0"][s] for s in range(8)]
  assert all(np.log(8) - 1 < h < np.log(8) for h in entropy), entropy
  assert len(set(entropy)) > 1, entropy
  images = read_images(workdir)["moe/expert_load"]
  # One per fetch: log_every=10 > 8 steps, so at the first checkpoint (step 1), at the eval
  # and checkpoint after step 4, and at the end.
  assert sorted(images) == [0, 3, 7]
  _assert_tensorboard_reads_at_a_glance(workdir, images[7], scalars)
  with open(os.path.join(workdir, "alerts.jsonl")) as f:
    alerts = [json.loads(line) for line in f]
  assert {"fallback_ran", "frequent_fallback"} <= {a["rule"] for a in alerts}
  first = next(a for a in alerts if a["rule"] == "fallback_ran")
  # It describes the step, as its points do: every layer that fell back, the largest factor.
  step = next(s for s, f in enumerate(fallbacks) if f > 0)
  assert first["step"] == step and len(first["layers"]) == fallbacks[step]
  assert first["layers"] == [i for i in range(recorded.counts.shape[1])
                             if scalars[f"moe/fallback_chunks/layer_{i}"][step] > 0]
  assert first["required_factor"] == pytest.approx(required[step], rel=1e-6)
  # The rule names a factor from its minimum window (2 steps here) on.
  recommended = first["recommended_ragged_buffer_factor"]
  assert (recommended is None) == (step < 1) and (recommended is None or recommended > FACTOR)
  # It names where the traffic overflowed.
  where = first["hotspots"][0]
  assert where["layer"] == 0 and where["receivers"] and len(where["hot_experts"]) == 3
  assert set(where["receivers"]) <= set(range(8)) and set(where["hot_experts"]) <= set(range(8))
  assert "layer 0: expert shards" in first["message"]
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints")))[-1] == "8"
  # The planner on the recorded traffic.
  [at_run] = replay.plan(recorded, [FACTOR])
  assert at_run["fallback_frequency"] == pytest.approx(np.mean([f > 0 for f in fallbacks]))
  assert at_run["overflowing_layers_mean"] == pytest.approx(np.mean(fallbacks))


def test_an_interval_is_written_while_the_next_step_runs(baseline, tmp_path, monkeypatch):
  """At a log boundary with no eval or checkpoint, the interval's outputs are fetched and
  written once the next step is dispatched (the device is not idle while the host writes);
  before an eval, a checkpoint and at the end, at once. Every step is still written, with
  the baseline's losses."""
  dispatched, fetches = [0], []
  def counted(settings, mesh):
    steps = _STEPS(settings, mesh)
    def train(state, batch):
      dispatched[0] += 1
      return steps.train(state, batch)
    return steps._replace(train=train)
  flush = reporter_lib.Reporter.flush
  def recorded(self, pending, **kwargs):
    if pending:
      fetches.append(([p.step for p in pending], dispatched[0]))
    return flush(self, pending, **kwargs)
  monkeypatch.setattr(trainer, "make_steps", counted)
  monkeypatch.setattr(reporter_lib.Reporter, "flush", recorded)
  # log_every=2; a checkpoint after step 0 (the first), eval and checkpoint after steps 3
  # and 7 (tiny config: every 4): (steps fetched, steps dispatched by then).
  losses = trainer.train_and_evaluate(settings_of(run_config(log_every=2)), str(tmp_path))
  assert fetches == [([0], 1), ([1], 3), ([2, 3], 4), ([4, 5], 7), ([6, 7], 8)]
  np.testing.assert_allclose(losses, baseline.losses, rtol=1e-6)
  scalars = read_scalars(str(tmp_path))
  for tag in ("train/loss", "moe/fallback_chunks/layer_0", "moe/ragged_buffer_factor"):
    assert sorted(scalars[tag]) == list(range(8)), tag
  assert sorted(scalars["train/tokens_per_second"]) == [0, 1, 3, 5, 7]  # one per fetch


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
    c = run_config()
    c.data.source, c.data.pattern = "files", pattern
    return c
  pattern = _text_corpus(tmp_path / "corpus")
  straight = trainer.train_and_evaluate(settings_of(config()), str(tmp_path / "straight"))
  first = trainer.train_and_evaluate(settings_of(config()), str(tmp_path / "resumed"), stop_after=3)
  rest = trainer.train_and_evaluate(settings_of(config()), str(tmp_path / "resumed"))
  assert len(first) == 3 and len(rest) == 5  # resumed from a step that is not a save interval
  np.testing.assert_allclose(first + rest, straight, rtol=1e-6)
  a, b = (read_scalars(str(tmp_path / run)) for run in ("straight", "resumed"))
  # The recommendation has points from the rule's minimum window (2 steps) on.
  for tag, first_step in (("moe/fallback_frequency", 0), (RECOMMENDED, 1)):
    assert sorted(b[tag]) == sorted(a[tag]) == list(range(first_step, 8)), tag
    np.testing.assert_allclose([b[tag][s] for s in b[tag]], [a[tag][s] for s in b[tag]],
                               rtol=1e-6, err_msg=tag)
  # The window is not trivially constant: the recommended factor moves as steps enter it.
  assert len({round(v, 6) for v in a[RECOMMENDED].values()}) > 1


@pytest.mark.slow
def test_step_mode_matches_layer_fallback(baseline, tmp_path):
  """All-to-all path (the ring's is tested at the layer, tests/test_step_mode.py): the step
  that runs dropless from its first overflowing layer on, its state donated, gives the loss
  curve of the in-layer fallback (both are the dropless model), a step runs dropless exactly
  when the layer run fell back at that step, and the capped model without a fallback ('none')
  differs."""
  def mode(name, **overrides):
    c = run_config(**overrides)
    c.moe.moe_dropless_fallback = name
    return c
  layer_dir, layer, _ = baseline
  step_mode = trainer.train_and_evaluate(settings_of(mode("step")), str(tmp_path / "step"))
  # The 'none' run also shows `moe_metrics=False`: training scalars only, nothing of the MoE's.
  quiet_config = mode("none", moe_metrics=False)
  capped = trainer.train_and_evaluate(settings_of(quiet_config), str(tmp_path / "none"))
  quiet = read_scalars(str(tmp_path / "none"))
  np.testing.assert_allclose([quiet["train/loss"][s] for s in range(8)], capped, rtol=1e-6)
  assert not [t for t in quiet if t.startswith(("moe/", "learning/moe"))], sorted(quiet)
  assert not os.path.exists(tmp_path / "none" / "alerts.jsonl")
  np.testing.assert_allclose(step_mode, layer, rtol=1e-5)
  assert np.max(np.abs(np.subtract(capped, layer))) > 1e-3
  fell_back = read_scalars(layer_dir)["learning/moe_dropless_fallback_layers"]
  total = read_scalars(str(tmp_path / "step"))["moe/dropless_steps"]  # a running count
  per_step = np.diff([0] + [total[s] for s in range(8)])
  np.testing.assert_array_equal(per_step, [fell_back[s] > 0 for s in range(8)])
  assert per_step.sum() >= 1
  # One compiled step (the run's own), its train state donated (no second copy of params and
  # Adam state).
  config = mode("step")
  steps = _STEPS(settings_of(config), moe_hk.make_mesh(**config.mesh))
  state = steps.init(jax.random.key(0))
  batch = jax.device_put(np.zeros((config.data.batch_size, config.data.seq_len + 1), np.int32),
                         steps.batch_sharding)
  _, out = steps.train(state, batch)
  assert out.dropless.dtype == bool
  assert all(leaf.is_deleted() for leaf in jax.tree.leaves(state))


@pytest.mark.slow
def test_bfloat16_compute_tracks_float32(baseline, tmp_path):
  """bf16 matmuls (params float32) follow the float32 loss curve within 2e-3 at every step,
  and really compute in bf16 (the curves differ)."""
  f32 = baseline.losses
  bf16 = trainer.train_and_evaluate(settings_of(run_config(dtype="bfloat16")),
                                    str(tmp_path / "bf16"))
  np.testing.assert_allclose(bf16, f32, rtol=2e-3)
  assert np.max(np.abs(np.subtract(bf16, f32))) > 0


def _started(proc, checkpoints, deadline_s=240) -> None:
  """Waits for the run's first checkpoint (training is then under way), and a little more."""
  deadline = time.time() + deadline_s
  while not (checkpoints.exists() and os.listdir(checkpoints)) and time.time() < deadline:
    assert proc.poll() is None, proc.communicate()[1][-3000:]
    time.sleep(1)
  time.sleep(3)


@pytest.mark.slow
@pytest.mark.parametrize("stop,status,notice", [
    (signal.SIGTERM, 0, "SIGTERM: finishing the current step"),
    # Ctrl-C: the same stop, exit status 130 (an interrupted command's) and the line that says so.
    (signal.SIGINT, 130, "SIGINT (Ctrl-C): finishing the current step, then checkpointing "
                         "(Ctrl-C again exits at once)")])
def test_a_stop_signal_checkpoints_the_current_step_and_the_run_resumes(tmp_path, stop, status,
                                                                        notice):
  proc = launch(tmp_path, "--config.train_steps=1000", "--config.checkpoint_every=500")
  checkpoints = tmp_path / "checkpoints"
  _started(proc, checkpoints)
  proc.send_signal(stop)
  stdout, stderr = proc.communicate(timeout=120)
  assert proc.returncode == status, stderr[-3000:]
  assert notice in stderr and "Traceback" not in stderr
  saved = max(int(s) for s in os.listdir(checkpoints) if s.isdigit())
  assert 1 < saved < 1000
  if stop == signal.SIGINT:
    assert stdout.splitlines()[-1] == (f"stopped by Ctrl-C after step {saved - 1} with a "
                                       "checkpoint; the same command resumes.")
  # The last progress line is the stopping interval's: no ETA (the run does not go on), and
  # no speed unless it ended at a boundary (an eval every 4 steps, a log every 10).
  lines = stdout.splitlines()
  last = lines[lines.index(f"stopping after step {saved - 1} with a checkpoint "
                           f"(checkpoints/{saved})") - 1]
  assert last.startswith(f"step {saved - 1} ({saved}/1000) | ") and "ETA" not in last, last
  assert ("tok/s" in last) == (saved % 4 == 0 or saved % 10 == 0), last
  scalars = read_scalars(str(tmp_path))
  assert sorted(scalars["train/loss"]) == list(range(saved))  # metrics flushed up to the stop
  # The resumed steps, and the steps before the stop, equal an uninterrupted run's.
  config = tiny_config(train_steps=1000, checkpoint_every=500)
  resumed = trainer.train_and_evaluate(settings_of(config), str(tmp_path), stop_after=saved + 2)
  straight = trainer.train_and_evaluate(settings_of(config), str(tmp_path / "straight"),
                                       stop_after=saved + 2)
  np.testing.assert_allclose(resumed, straight[saved:], rtol=1e-6)
  np.testing.assert_allclose([scalars["train/loss"][s] for s in range(saved)],
                             straight[:saved], rtol=1e-6)
  # The alerts' rate limits and "since" came back with the checkpoint: the resume fires none
  # that the uninterrupted run did not (the tiny config falls back from step 0 on, so a resume
  # that forgot them would fire fallback_ran again at step `saved`).
  alerts = _alerts(tmp_path, since=True)
  assert alerts and alerts[0][0] < saved
  assert alerts == _alerts(tmp_path / "straight", since=True)


def test_a_second_ctrl_c_exits_at_once(monkeypatch, capsys):
  """The first Ctrl-C asks for a stop (the loop reads it at the next step); a second one
  ends the process at once, exit status 130, in one line. What it leaves on disk is what any
  abrupt exit leaves: orbax moves a checkpoint into place only once whole, so the newest
  complete one restores (an abrupt kill mid-run: the lost-process test below resumes)."""
  exits = []
  monkeypatch.setattr(stop_request.os, "_exit", exits.append)
  before = signal.getsignal(signal.SIGINT)  # pytest's; SIG_IGN when started in the background
  stop = stop_request.StopRequest()
  try:
    stop._handle(signal.SIGINT, None)
    assert stop.should_stop() and stop.interrupted and exits == []
    stop._handle(signal.SIGINT, None)
    assert exits == [130]
    assert capsys.readouterr().err == (
        "second Ctrl-C: exiting now, without a checkpoint of this step (the newest complete "
        "checkpoint stays as it is).\n")
  finally:
    stop.restore()
  assert signal.getsignal(signal.SIGINT) is before


def _alerts(workdir, since: bool = False) -> list[tuple]:
  """(step, rule, layers[, since]) of each line of `workdir/alerts.jsonl`."""
  path = os.path.join(workdir, "alerts.jsonl")
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [(a["step"], a["rule"], a["layers"], *([a["since"]] if since else []))
            for a in map(json.loads, f)]


def _two_processes(workdir, *flags, port=None):
  """Processes 0 and 1 of a 2 x 4-device run of the tests' tiny config at FACTOR."""
  port = port or free_port()
  return [launch(workdir, f"--process_id={i}", f"--config.moe.ragged_buffer_factor={FACTOR}",
                 "--config.autopilot.min_steps=2", "--num_processes=2",
                 f"--coordinator_address=127.0.0.1:{port}", *flags, devices=4) for i in range(2)]


class LostRun(NamedTuple):
  """Two processes (2 x 4 CPU devices over gloo) of the 8-step baseline run, process 1 killed
  after a checkpoint, then both commands run again to the end."""
  workdir: str
  status: int                        # process 0's exit status after the kill
  took: float                        # seconds from the kill to process 0's exit
  stderr: str                        # process 0's, after the kill
  saved: int                         # the newest checkpoint when process 0 ended
  alerts: tuple[list, list]          # alerts.jsonl's lines of the first pair, of the rerun
  rerun: list[tuple[int, str, str]]  # each rerun process's exit status, stdout, stderr


@pytest.fixture(scope="module")
def lost_run(tmp_path_factory) -> LostRun:
  """The two-process run the gloo and lost-process tests read (one run: four compiles)."""
  workdir = tmp_path_factory.mktemp("lost")
  flags = ("--config.train_steps=8", "--config.checkpoint_every=2",
           "--config.heartbeat_timeout_s=5")
  first = _two_processes(workdir, *flags)
  _started(first[0], workdir / "checkpoints", deadline_s=300)
  first[1].kill()
  lost_at = time.time()
  _, stderr = first[0].communicate(timeout=120)
  took = time.time() - lost_at
  first[1].communicate()
  saved = max(int(s) for s in os.listdir(workdir / "checkpoints") if s.isdigit())
  before = _alerts(workdir, since=True)
  again = _two_processes(workdir, *flags)
  outputs = [p.communicate(timeout=600) for p in again]
  rerun = [(p.returncode, out, err) for p, (out, err) in zip(again, outputs)]
  return LostRun(str(workdir), first[0].returncode, took, stderr, saved,
                 (before, _alerts(workdir, since=True)[len(before):]), rerun)


@pytest.mark.slow
def test_two_processes_over_gloo_match_one_process(baseline, lost_run):
  """2 processes x 4 CPU devices on loopback (jax.distributed, gloo collectives) train the
  same 8-device mesh as one process and give the same losses: `lost_run`, resumed after
  losing a process, against the 8-step baseline. Process 0 alone writes the alerts (the
  one-process run's, no more: the first pair's before its newest checkpoint, the rerun's
  from it on) and the console's progress; process 1 prints its platform line and nothing
  else; neither prints gloo's rank lines."""
  for status, _, stderr in lost_run.rerun:
    assert status == 0, stderr[-3000:]
  losses = read_scalars(lost_run.workdir)["train/loss"]
  np.testing.assert_allclose([losses[s] for s in range(8)], baseline.losses, rtol=1e-5)
  expected = _alerts(baseline.workdir, since=True)
  first, rerun = lost_run.alerts
  saved = lost_run.saved
  assert expected and [a for a in first if a[0] < saved] == [a for a in expected if a[0] < saved]
  assert rerun == [a for a in expected if a[0] >= saved]
  (_, out0, err0), (_, out1, err1) = lost_run.rerun
  assert "step 7 (8/8) | loss" in out0 and out0.startswith("process 0/2: platform cpu: 8 devices")
  assert out1.strip() == "process 1/2: platform cpu: 8 devices, 4 local, 2 processes", out1
  assert "alerts.py" not in err1 and "MoE overflow" not in err1, err1[-2000:]
  for output in (out0, err0, out1, err1, lost_run.stderr):
    assert "[Gloo]" not in output


@pytest.mark.slow
def test_a_lost_process_ends_the_run_in_one_line_and_the_rerun_resumes(lost_run):
  """kill -9 of process 1 after a checkpoint: process 0 ends within the heartbeat timeout (5 s
  here) and a margin, exit status 1, one line naming the lost process and the newest
  checkpoint; the same two commands resume from it (their losses: the test above)."""
  saved, stderr = lost_run.saved, lost_run.stderr
  assert lost_run.status == 1 and lost_run.took < 5 + 40, (lost_run.status, lost_run.took,
                                                           stderr[-2000:])
  assert stderr.splitlines()[-1] == (
      f"launch.train: error: process 1 of 2 stopped answering (no heartbeat for "
      f"config.heartbeat_timeout_s=5 s); the newest checkpoint is {lost_run.workdir}/checkpoints/"
      f"{saved} (after step {saved - 1}): rerun every process's command to resume from it.")
  assert "Traceback" not in stderr and "Check failure" not in stderr
  assert [status for status, _, _ in lost_run.rerun] == [0, 0]
  assert sorted(int(s) for s in os.listdir(os.path.join(lost_run.workdir, "checkpoints"))
                if s.isdigit())[-1] == 8


# Bad values: the message each check gives, in this process (the two command-line cases below
# prove the exit status and the one-line form).
@pytest.mark.parametrize("key,value,message", [
    ("moe.num_experts", 12, "MoEConfig.num_experts=12 must be divisible by the size of "
                            "mesh axis 'expert' (8)"),
    ("moe.ragged_buffer_factor", 0.0, "MoEConfig.ragged_buffer_factor=0.0 is invalid"),
    ("data.batch_size", 12, "config.data.batch_size=12 must be divisible by the 8"),
    ("attention_block", 5, "config.attention_block=5 must be 0 (whole sequence) or a "
                           "divisor of config.data.seq_len=32"),
    ("num_layers", 3, "config.moe_every=2 must divide config.num_layers=3"),
    ("moe.moe_dropless_fallback", "always", "MoEConfig.moe_dropless_fallback='always' "
                                            "is invalid: must be one of 'none', 'layer', "
                                            "'step'"),
    ("moe.expert_axis", "model", "MoEConfig.expert_axis='model' is not an axis of the mesh "
                                 "(axes: data, fsdp, expert)"),
    ("mesh.expert", 4, "config.mesh: the mesh (data=1, fsdp=1, expert=4) needs 4 devices; "
                       "there are 8. Set config.mesh to fit the devices, or, on a machine "
                       "without a TPU or GPU, config.cpu_devices to the mesh's size."),
    ("remat_policy", "most", "config.remat_policy='most' must be one of 'none', 'full', "
                             "'save_attention_moe', 'save_dots', 'save_matmuls', "
                             "'full_inputs_on_host'."),
    ("remat_unit", "layer", "config.remat_unit='layer' must be one of 'group', 'block'."),
    ("layer_scan_unroll", 0, "config.layer_scan_unroll=0 must be an integer >= 1 (layer "
                             "groups per iteration of the scan over groups"),
    # The factor rule's window serves the telemetry too: checked with the autopilot off.
    ("autopilot.window", 2, "config.autopilot.min_steps=20 must be in [1, "
                            "config.autopilot.window=2]"),
    ("data.source", "webdataset", "config.data.source='webdataset' must be one of 'stdlib', "
                                  "'synthetic', 'files', 'array_record'."),
    ("spikes.window", 3, "config.spikes.window=3 must be >= 4"),
])
def test_bad_config_value_names_field_value_and_range(key, value, message):
  c = tiny_config()
  c.update_from_flattened_dict({key: value})
  if message is None:
    settings_lib.build(c, 8)
    return
  with pytest.raises(UserError) as error:
    settings_lib.build(c, 8)
  assert message in str(error.value) and "\n" not in str(error.value)


def test_unknown_key_names_the_closest_keys(tmp_path):
  """A key the config does not have, from the command line or in a config file.
  (`--num_processes` without its two partners: tests/test_distributed.py.)"""
  with pytest.raises(settings_lib.app.UsageError) as error:
    settings_lib.load(os.path.join(ROOT, TINY), [("moe.expert_axes", "data")])
  assert str(error.value).startswith("--config.moe.expert_axes: no such config key (closest: "
                                     "config.moe.expert_axis, "), error.value
  assert error.value.exitcode == 2
  c = tiny_config()
  c.moe.expert_axes = "data"
  with pytest.raises(UserError, match=r"^config\.moe\.expert_axes is not a MoE setting; did "
                                      r"you mean config\.moe\.expert_axis"):
    settings_lib.build(c, 8)


@pytest.mark.parametrize("flag,message", [
    ("--config.moe.num_experts=12", "MoEConfig.num_experts=12 must be divisible by the size "
                                    "of mesh axis 'expert' (8)"),
    ("--config.moe.dropless_fallback=layer", "--config.moe.dropless_fallback: no such config "
                                             "key (closest: config.moe.moe_dropless_fallback"),
])
def test_bad_config_on_the_command_line_is_a_short_clear_error(tmp_path, flag, message):
  proc = launch(tmp_path, flag)
  _, stderr = proc.communicate(timeout=300)
  assert proc.returncode != 0
  assert message in stderr
  assert "Traceback" not in stderr


def test_config_moe_keys_are_the_layer_fields():
  """One vocabulary: `config.moe` holds exactly the `MoEConfig` fields the launcher does not
  derive (width, dtype, traffic recording), under their own names, and the launcher builds
  the layer config from them."""
  c = tiny_config()
  fields = {f.name for f in dataclasses.fields(moe_hk.MoEConfig)}
  derived = {"emb_dim", "dtype", "record_traffic"}
  assert set(c.moe) == fields - derived and set(c.moe) | derived == fields
  c.moe.gmm_impl, c.moe.gmm_block_rows, c.moe.a2a_impl = "blocked", 16, "emulated"
  c.traffic.record = False
  built = settings_of(c).layer
  assert (built.gmm_impl, built.gmm_block_rows, built.a2a_impl) == ("blocked", 16, "emulated")
  assert (built.emb_dim, built.dtype, built.record_traffic) == (c.emb_dim, c.dtype, False)


def test_moe_metrics_off_turns_the_layers_callbacks_off_and_says_so():
  """`moe_metrics=False` alone is a run without MoE telemetry: the layer's host callbacks,
  which only feed it, are off too, and the console says what the run does not record."""
  on = settings_of(tiny_config()).layer
  assert on.emit_fallback_events and not on.stream_step_stats  # the config file's values
  c = tiny_config(moe_metrics=False)
  c.moe.stream_step_stats = True
  off = settings_of(c).layer
  assert not off.stream_step_stats and not off.emit_fallback_events
  c.traffic.record = False
  lines = trainer.not_recorded(c)
  assert len(lines) == 2 and lines[0].startswith("MoE telemetry off (config.moe_metrics=False)")
  assert lines[1].startswith("traffic recording off (config.traffic.record=False)")
  assert trainer.not_recorded(tiny_config()) == []


def _autopilot_config():
  """The baseline's model from factor 4.0, its worst case (min(P=8, E/K=4)): nothing can
  overflow, so after its 4-step window the autopilot can only lower the factor, whatever the
  router's numerics on this jax version; one candidate program at most (a compile costs more
  than this run), compiled while the step waits for it."""
  c = run_config(checkpoint_every=500)
  c.moe.ragged_buffer_factor = 4.0
  c.autopilot.update(enabled=True, objective="fallback_frequency", target_fallback_frequency=0.3,
                     window=4, max_programs=1, wait=True)
  return c


@pytest.mark.slow
def test_autopilot_lowers_the_factor_drops_nothing_and_resumes_with_it(baseline, tmp_path):
  """Switching factors changes the program, never the math: the loss curve equals the
  dropless baseline's (a fixed factor with the fallback), nothing is dropped, the change is
  alerted, and a run resumed after the change continues with the lowered factor from its
  checkpoint."""
  auto = str(tmp_path / "auto")
  first = trainer.train_and_evaluate(settings_of(_autopilot_config()), auto, stop_after=5)
  rest = trainer.train_and_evaluate(settings_of(_autopilot_config()), auto)
  np.testing.assert_allclose(first + rest, baseline.losses, rtol=1e-5)
  scalars = read_scalars(auto)
  factors = [scalars["moe/ragged_buffer_factor"][s] for s in range(8)]
  assert factors[:4] == [4.0] * 4 and factors[4] < 4.0, factors
  assert factors[5:] == [factors[4]] * 3, factors  # the resumed run kept the checkpoint's
  assert all(scalars["moe/dropped_rows_fraction"][s] == 0 for s in range(8))
  with open(tmp_path / "auto" / "alerts.jsonl") as f:
    changes = [a for a in map(json.loads, f) if a["rule"] == "buffer_factor_changed"]
  assert [(c["step"], c["old_factor"], c["new_factor"])
          for c in changes] == [(4, 4.0, factors[4])]
  assert changes[0]["reason"] == "frequency"




@pytest.mark.slow
def test_console_reports_compile_progress_and_a_summary(baseline):
  """The operator's lines: compiling and its time, one progress line per fetch (loss, speed,
  the model's TFLOP/s per device, what the MoE layers did, the factor, an ETA; no MFU on CPU),
  and the summary with where things are."""
  lines = baseline.console.splitlines()
  assert lines[0] == "compiling the train step (it runs once compiled) ..."
  assert re.fullmatch(r"first step: \d+\.\d s \(compilation included\)", lines[1]), lines[1]
  progress = [line for line in lines if line.startswith("step ")]
  # One per fetch: after steps 0, 3 and 7 (checkpoints, eval, the end; log_every=10), each
  # with the steps done.
  assert [line.split(" | ")[0] for line in progress] == ["step 0 (1/8)", "step 3 (4/8)",
                                                         "step 7 (8/8)"]
  fell_back = read_scalars(baseline.workdir)["learning/moe_dropless_fallback_layers"]
  for line, steps in zip(progress, ([0], [1, 2, 3], [4, 5, 6, 7])):
    fields = line.split(" | ")
    assert fields[1] == f"loss {baseline.losses[steps[-1]]:.4g}", line
    fallback = f"fallback {sum(fell_back[s] > 0 for s in steps)}/{len(steps)} steps"
    if steps[0] == 0:  # the interval that compiled: no speed, no ETA
      assert fields[2:] == [fallback, f"factor {FACTOR:g}"], line
      continue
    assert re.fullmatch(r"[\d.]+k? tok/s", fields[2]) and fields[3].endswith(" s/step"), line
    # The model's FLOPs a step (6 x active parameters x tokens + attention) per second and
    # device, as the tag has it; no MFU without a peak (CPU).
    seconds = float(fields[3].split()[0])
    tflops = read_scalars(baseline.workdir)["train/model_tflops_per_device"][steps[-1]]
    assert fields[4] == f"{tflops:.3g} TFLOP/s/dev", line
    assert tflops == pytest.approx(54_116_352 / seconds / 8 / 1e12, rel=5e-3)
    assert fields[5] == fallback
    assert fields[6] == f"factor {FACTOR:g}" and re.fullmatch(r"ETA \d+:\d\d:\d\d", fields[7]), line
  assert progress[-1].endswith("ETA 0:00:00")
  assert "train/mfu" not in read_scalars(baseline.workdir)
  writing, written, done, where = lines[-4:]
  # The final checkpoint's write, announced with its size and timed (a 0.7B model's outlasted
  # the last step line by ~50 s in silence).
  assert re.fullmatch(rf"writing checkpoint {re.escape(baseline.workdir)}/checkpoints/8 "
                      r"\([\d.]+ MiB of train state\) \.\.\.", writing), writing
  assert re.fullmatch(r"checkpoint 8 written \(\d+\.\d s\)", written), written
  total = sum(fell_back[s] > 0 for s in range(8))
  assert re.fullmatch(rf"done: steps 0-7 in \d+:\d\d:\d\d \| loss {baseline.losses[-1]:.4g} "
                      rf"\(eval [\d.]+\) \| fallback in {total}/8 steps \| dropped 0 rows \| "
                      r"skipped 0 non-finite steps", done), done
  with open(os.path.join(baseline.workdir, "alerts.jsonl")) as f:
    alerts = len(f.readlines())
  # TensorBoard's command runs as typed: the venv's own tensorboard (.venv/bin/tensorboard
  # from the checkout).
  tensorboard = os.path.join(os.path.relpath(os.path.dirname(sys.executable)), "tensorboard")
  assert os.access(tensorboard, os.X_OK)
  assert where == (f"alerts: {alerts} new in {baseline.workdir}/alerts.jsonl | TensorBoard: "
                   f"{tensorboard} --logdir {baseline.workdir} | checkpoint: "
                   f"{baseline.workdir}/checkpoints/8 (after step 7)")


@pytest.mark.slow  # it reads the baseline run (30 s to train), like the cases above
def test_rerun_of_a_finished_run_says_so_and_changes_nothing(baseline, capsys):
  before = sorted(os.listdir(baseline.workdir))
  assert trainer.train_and_evaluate(settings_of(run_config()), baseline.workdir) == []
  assert capsys.readouterr().out == (
      f"{baseline.workdir} has trained steps 0-7, config.train_steps=8: nothing to train. To "
      "train longer, rerun with --config.train_steps=N (N > 8); the learning-rate schedule "
      "ends at step 8 (rate 0 after it) unless --config.schedule_steps=N re-plans it.\n")
  assert sorted(os.listdir(baseline.workdir)) == before


@pytest.mark.slow  # it reads the baseline run
def test_a_changed_model_key_ends_the_start_in_one_line_and_keeps_the_record(baseline,
                                                                              monkeypatch):
  """A resume with a key that shapes the checkpoints changed is refused before anything is
  built, restored or written: one line naming each such key, old and new."""
  record_path = os.path.join(baseline.workdir, "config.json")
  with open(record_path) as f:
    before = f.read()
  listed = sorted(os.listdir(baseline.workdir))
  config = run_config(emb_dim=64, optimizer_state_dtype="bfloat16")
  _no_compiling(monkeypatch)
  with pytest.raises(UserError) as refused:
    trainer.train_and_evaluate(settings_of(config), baseline.workdir)
  assert str(refused.value) == (
      f"{baseline.workdir} holds checkpoints of another model: config.emb_dim 32 -> 64, "
      "config.optimizer_state_dtype 'float32' -> 'bfloat16' changed since its last start "
      f"({record_path}); start a new run in another --workdir, or drop the override to resume "
      "this one.")
  with open(record_path) as f:
    assert f.read() == before
  assert sorted(os.listdir(baseline.workdir)) == listed


def _cosine_rate(step: int, total: int, warmup: int = 2, peak: float = 3e-3) -> float:
  """The warmup-then-cosine learning rate, written out: 0 from step `total` on."""
  if step < warmup:
    return peak * step / warmup
  done = min(step - warmup, total - warmup) / (total - warmup)
  return peak * 0.5 * (1 + np.cos(np.pi * done))


@pytest.mark.slow  # it resumes a copy of the baseline run
def test_raising_train_steps_keeps_the_schedule_and_says_so(baseline, tmp_path, capsys):
  """train_steps 8 -> 10 on resume: the rate goes on along the first start's 8-step schedule
  (0 from step 8; a re-planned one would be 4.4e-4 at step 8), the console says what changed
  and what the rate is, and the start's config is kept beside the first's. An explicit
  schedule_steps re-plans it, and the console states the rate at the resume step before and
  after."""
  workdir = str(tmp_path / "run")
  shutil.copytree(baseline.workdir, workdir)
  capsys.readouterr()
  assert len(trainer.train_and_evaluate(settings_of(run_config(train_steps=10)), workdir)) == 2
  lines = capsys.readouterr().out.splitlines()
  assert lines[:2] == [
      "changed since the last start: train_steps 8 -> 10",
      "learning rate: the schedule ends at step 8 (config.schedule_steps, as recorded); steps "
      "8-9 train at rate 0: --config.schedule_steps=N re-plans it."]
  rates = read_scalars(workdir)["train/learning_rate"]
  np.testing.assert_allclose([rates[s] for s in range(10)],
                             [_cosine_rate(s, 8) for s in range(10)], rtol=1e-5, atol=1e-9)
  assert sorted(os.listdir(os.path.join(workdir, "configs"))) == ["0.json", "8.json"]
  assert settings_lib.saved(workdir).schedule_steps == 8
  start = run_config_lib.check(run_config(train_steps=12, schedule_steps=12), workdir)
  assert start.config.schedule_steps == 12 and "schedule_steps 8 -> 12" in start.changed
  assert run_config_lib.schedule_notes(start, 10) == [
      f"config.schedule_steps 8 -> 12 re-plans the learning rate: at step 10 it was 0, it is "
      f"now {_cosine_rate(10, 12):.3g}."]


def _no_compiling(monkeypatch) -> None:
  """The trainer's step functions (jitted, so compiled on first use) must not be built."""
  def refuse(*args, **kwargs):
    raise AssertionError("the trainer built its steps before the error")
  monkeypatch.setattr(trainer, "make_steps", refuse)


@pytest.mark.parametrize("where", ["file", "proc"])
def test_unwritable_workdir_is_a_user_error_before_compiling(tmp_path, where, monkeypatch):
  workdir = {"file": tmp_path / "a_file", "proc": "/proc/moe-hk"}[where]
  if where == "file":
    workdir.write_text("")
  _no_compiling(monkeypatch)
  with pytest.raises(UserError, match=rf"workdir '{workdir}' cannot be created or written "
                                      r"\(.+\): pass a folder this user can write\.$"):
    trainer.train_and_evaluate(settings_of(tiny_config()), str(workdir))


def test_data_that_does_not_match_is_a_user_error_before_compiling(tmp_path, monkeypatch):
  c = tiny_config()
  c.data.source, c.data.pattern = "files", str(tmp_path / "*.txt")
  _no_compiling(monkeypatch)
  with pytest.raises(UserError, match=r"matches no file"):
    trainer.train_and_evaluate(settings_of(c), str(tmp_path / "run"))
  assert not os.path.exists(tmp_path / "run" / "checkpoints")


def _truncate_arrays(checkpoint: str) -> None:
  """Cuts every data file of one checkpoint's train state to half its size (all of them: a
  file orbax wrote but does not read back, seen on Python 3.12, must not keep it readable)."""
  files = [f for f in glob.glob(os.path.join(checkpoint, "state", "**"), recursive=True)
           if os.path.isfile(f) and "/d/" in f]
  assert files, checkpoint
  for path in files:
    with open(path, "r+b") as f:
      f.truncate(os.path.getsize(path) // 2)


@pytest.mark.slow
def test_unreadable_checkpoints_are_moved_aside_and_the_run_resumes(baseline, tmp_path, caplog):
  """Checkpoints 1, 4 and 6; 6 gets truncated array files and 4 garbage for its data
  iterator's JSON. With 1 unreadable too, the run stops in one line naming the folder and
  moves nothing; with 1 intact, 6 and 4 are moved to corrupt-<step> with a warning each and
  the run resumes from step 1, reproducing the uninterrupted run (losses, MoE window)."""
  workdir = str(tmp_path / "run")
  checkpoints = os.path.join(workdir, "checkpoints")
  trainer.train_and_evaluate(settings_of(run_config()), workdir, stop_after=6)
  assert sorted(os.listdir(checkpoints)) == ["1", "4", "6"]
  shutil.copytree(os.path.join(checkpoints, "1"), tmp_path / "backup-1")
  _truncate_arrays(os.path.join(checkpoints, "6"))
  with open(os.path.join(checkpoints, "4", "data", "metadata"), "w") as f:
    f.write("{not json")
  _truncate_arrays(os.path.join(checkpoints, "1"))
  with pytest.raises(UserError, match=rf"no checkpoint in {checkpoints} reads \(step 6: .*; "
                                      r"step 4: .*; step 1: .*\): move the folder away"):
    trainer.train_and_evaluate(settings_of(run_config()), workdir)
  assert sorted(os.listdir(checkpoints)) == ["1", "4", "6"]

  shutil.rmtree(os.path.join(checkpoints, "1"))
  shutil.copytree(tmp_path / "backup-1", os.path.join(checkpoints, "1"))
  caplog.set_level("WARNING")
  rest = trainer.train_and_evaluate(settings_of(run_config()), workdir)
  assert sorted(os.listdir(checkpoints)) == ["1", "4", "8", "corrupt-4", "corrupt-6"]
  moved = [r.getMessage() for r in caplog.records if "does not read" in r.getMessage()]
  assert [m.split(" (")[0] for m in moved] == ["checkpoint 6 does not read",
                                               "checkpoint 4 does not read"], moved
  np.testing.assert_allclose(rest, baseline.losses[1:], rtol=1e-6)
  a, b = read_scalars(baseline.workdir), read_scalars(workdir)
  for tag in ("moe/fallback_frequency", RECOMMENDED):
    assert sorted(b[tag]) == sorted(a[tag]), tag
    np.testing.assert_allclose([b[tag][s] for s in b[tag]], [a[tag][s] for s in b[tag]],
                               rtol=1e-6, err_msg=tag)


@contextlib.contextmanager
def _tmpfs(path: str):
  """A 64 MiB tmpfs mounted at `path` for the block; yields a `remount(options)` (needs root,
  which CI and this machine's sessions have: elsewhere the test skips, in CI it fails)."""
  os.makedirs(path)
  done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", path],
                        capture_output=True, text=True)
  if done.returncode:
    unavailable(f"cannot mount a tmpfs for a read-only or full folder ({done.stderr.strip()})")
  try:
    yield lambda options: subprocess.run(["mount", "-o", f"remount,{options}", path],
                                         check=True)
  finally:
    subprocess.run(["umount", path], check=True)


def _fill(folder: str, leave_bytes: int) -> str:
  """Writes a ballast file into `folder` until `leave_bytes` are free on its file system."""
  stat = os.statvfs(folder)
  path = os.path.join(folder, "ballast")
  with open(path, "wb") as f:
    f.write(b"\0" * (stat.f_bavail * stat.f_frsize - leave_bytes))
  return path


def _orbax_commits_waiting(within_s: float = 30.0) -> list[str]:
  """The names of orbax's commit threads (`_SignalingThread`) still alive `within_s` seconds
  on: a failed save's writes left waiting for a signal that never comes (their coroutines
  never run, a RuntimeWarning each when collected)."""
  deadline = time.time() + within_s
  threads = [t for t in threading.enumerate() if type(t).__name__ == "_SignalingThread"]
  for thread in threads:  # Thread's own join: orbax's raises the thread's error
    threading.Thread.join(thread, max(0.0, deadline - time.time()))
  return [t.name for t in threads if t.is_alive()]


@pytest.mark.slow
@pytest.mark.parametrize("failure", ["read_only", "disk_full"])
def test_failed_checkpoint_write_stops_in_one_line_and_keeps_the_previous(baseline, tmp_path,
                                                                          failure):
  """After step 4's checkpoint the folder turns read-only, or fills up with room for half the
  train state's bytes (the save at step 8 then fails part-way): the run stops with one line
  naming the newest intact checkpoint, and none of the failed save's writes is left waiting;
  once the folder is fixed the rerun resumes from it, with the uninterrupted run's losses,
  whatever the failed save left. (The room is not half of checkpoint 4's files: how many
  bytes orbax's data files take varies from one save to the next, 1.0 to 2.2 MB for this
  state, so that half of one checkpoint once held all of the next.)"""
  workdir = str(tmp_path / "run")
  checkpoints = os.path.join(workdir, "checkpoints")
  settings = settings_of(run_config())
  with _tmpfs(checkpoints) as remount:
    trainer.train_and_evaluate(settings, workdir, stop_after=4)
    state_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(_restored_state(settings, workdir)))
    ballast = _fill(checkpoints, state_bytes // 2) if failure == "disk_full" else None
    if failure == "read_only":
      remount("ro")
    with pytest.raises(UserError, match=rf"writing a checkpoint to {checkpoints} failed \(.*"
                                        r"\); checkpoints/4 is the newest intact one: free space "
                                        r"or fix "
                                        r"the folder's permissions, then rerun to resume\.$"):
      trainer.train_and_evaluate(settings, workdir)
    assert _orbax_commits_waiting() == []
    if ballast:
      os.remove(ballast)
    else:
      remount("rw")
    assert sorted(os.listdir(checkpoints)) == ["1", "4"]
    rest = trainer.train_and_evaluate(settings, workdir)
  np.testing.assert_allclose(rest, baseline.losses[4:], rtol=1e-6)


@pytest.mark.slow
def test_the_default_jobs_router_transient_is_no_collapse(tmp_path):
  """The default job's first 20 steps: the untrained router needs a factor within 10% of the
  worst case (4) on a few steps in a row, then balances; near_worst_case, which needs 10 in a
  row, stays quiet (a collapse that persists: tests/test_metrics_host.py). (XLA's ragged_dot
  for the experts, the tests' quicker compile: the same routing.) The run is the launcher's
  command, its steps' code optimised by LLVM (`launch`): 59 s of CPU, not 72 in this process
  (Python 3.11)."""
  workdir = str(tmp_path)
  run = launch(workdir, "--config.train_steps=20", "--config.eval_every=20",
               "--config.checkpoint_every=20", config="launch/configs/default.py", llvm_level=1)
  out, err = run.communicate(timeout=600)
  assert run.returncode == 0 and "done: steps 0-19" in out, err[-3000:]
  required = read_scalars(workdir)["moe/required_ragged_buffer_factor"]
  near = [s for s in range(20) if required[s] >= 0.9 * 4]
  assert near and len(near) < 10, required  # the transient is there, and short
  with open(os.path.join(workdir, "alerts.jsonl")) as f:
    rules = {json.loads(line)["rule"] for line in f}
  assert "near_worst_case" not in rules and "frequent_fallback" in rules


@pytest.mark.slow
def test_a_loss_spike_is_skipped_alerted_and_its_batch_found(baseline, tmp_path, monkeypatch):
  """With config.spikes on (window 8, 6 sigma), the first six steps train as the baseline;
  step 6 gets an injected batch of one byte repeated (0xFF, in no Python source), whose loss
  is far above the window's: the compiled step skips it (train/spike_skipped_steps, a
  loss_spike alert with the step's data position), the params, the optimizer state and the
  spike window are bit-equal across it (checkpoints 6 and 7), and `python -m launch.batch`
  prints the batch the data pipeline serves at that position."""
  make_data = data_lib.make_data
  def injected(config, **kw):
    data = make_data(config, **kw)
    served = data.train_batch
    data.train_batch = lambda step: np.full_like(served(step), 0xFF) if step == 6 else (
        served(step))
    return data
  monkeypatch.setattr(data_lib, "make_data", injected)
  c = run_config(checkpoint_every=1)
  c.spikes.update(enabled=True, window=8)
  workdir = str(tmp_path)
  losses = trainer.train_and_evaluate(settings_of(c), workdir)
  np.testing.assert_allclose(losses[:6], baseline.losses[:6], rtol=1e-6)
  scalars = read_scalars(workdir)
  assert [scalars["train/spike_skipped_steps"][s] for s in range(8)] == [0] * 6 + [1, 1]
  with open(os.path.join(workdir, "alerts.jsonl")) as f:
    [spike] = [a for a in map(json.loads, f) if a["rule"] == "loss_spike"]
  details = spike  # the rule's fields sit beside step, rule and message
  assert spike["step"] == 6 and details["loss"] == losses[6]
  # An untrained model's loss on 0xFF is near log(256), like its text's; the gradient spikes.
  spiked = [value > mean + 6 * std for value, mean, std in zip(
      (details["loss"], details["grad_norm"]), details["window_mean"], details["window_std"])]
  assert spiked[1] and "gradient norm" in spike["message"]
  assert spiked[0] == ("loss " in spike["message"].split("]")[1].split("above")[0])
  position = spike["data_position"]
  assert position == json.loads(json.dumps(make_data(c).position(6)))
  before, after = (_restored_state(settings_of(c), workdir, step) for step in (6, 7))
  jax.tree.map(np.testing.assert_array_equal, (before.params, before.opt_state, before.spikes),
               (after.params, after.opt_state, after.spikes))
  assert int(after.spikes.count) == 6  # the spike's values did not enter the window
  done = subprocess.run([sys.executable, "-m", "launch.batch", f"--workdir={workdir}",
                         "--step=6", "--rows=0", "--tokens=33"], cwd=ROOT, capture_output=True,
                        text=True, timeout=300)
  assert done.returncode == 0, done.stderr[-2000:]
  lines = done.stdout.splitlines()
  assert lines[0] == (f"step 6: {c.data.batch_size} rows x {c.data.seq_len + 1} tokens from "
                      f"source 'stdlib' (seed {c.data.seed})")
  batch = make_data(c).global_batch(6)
  for r, (line, where) in enumerate(zip(lines[1:], position["rows"])):
    text = repr(bytes(batch[r].astype(np.uint8)).decode("utf-8", "replace"))
    assert line == f"row {r}: {where['file']}:{where['offset']}: {text}", line


@pytest.mark.slow
@pytest.mark.parametrize("log_every,message", [
    # Fetched at the checkpoint and eval after step 3: the fourth skipped step stops the run.
    (10, r"4 steps in a row up to step 3"),
    # Each step fetched once the next one is dispatched: the third skipped step (step 2) stops
    # the run with step 3 dispatched, which is fetched, written and checkpointed too.
    (1, r"3 steps in a row up to step 2")])
def test_nonfinite_router_input_is_counted_skipped_and_stops_the_run(tmp_path, monkeypatch,
                                                                     log_every, message):
  """A NaN embedding row makes the tokens after that byte NaN in every MoE layer: they are
  counted, overflow nothing (no fallback), every step is skipped (alerted with its data
  position) and after max_consecutive_nonfinite=3 such steps the run stops with a checkpoint,
  every step it ran written. The checkpointed params and optimizer state are the initial
  ones, bit for bit: the skipped updates changed nothing (without the step's select they would
  be NaN everywhere)."""
  initial = {}
  def poisoned(settings, mesh):
    steps = _STEPS(settings, mesh)
    def init(rng):
      state = steps.init(rng)
      [scope] = [name for name in state.params if name.endswith("/embed")]
      table = state.params[scope]["embeddings"].at[ord(" ")].set(np.nan)
      return state._replace(params={**state.params, scope: {"embeddings": table}})
    jitted = jax.jit(init, out_shardings=steps.state_sharding)
    def kept(rng):  # the state the run starts from, kept on the host
      state = jitted(rng)
      initial["state"] = jax.device_get(state)
      return state
    return steps._replace(init=kept)
  monkeypatch.setattr(trainer, "make_steps", poisoned)
  c = run_config(max_consecutive_nonfinite=3, log_every=log_every)
  with pytest.raises(UserError, match=message + r" had a non-finite or spiking loss or "
                                      r"gradient norm \(config.max_consecutive_nonfinite=3\); "
                                      r"they changed nothing, and the state is checkpointed "
                                      r"after step 3 \(checkpoints/4\)"):
    trainer.train_and_evaluate(settings_of(c), str(tmp_path))
  scalars = read_scalars(str(tmp_path))
  assert [scalars["train/skipped_steps"][s] for s in range(4)] == [1, 2, 3, 4]
  assert all(np.isnan(scalars["train/loss"][s]) for s in range(4))
  for s in range(4):
    assert scalars["moe/nonfinite_tokens/layer_0"][s] > 0
    assert scalars["learning/moe_dropless_fallback_layers"][s] == 0
  with open(tmp_path / "alerts.jsonl") as f:
    alerts = [json.loads(line) for line in f]
  rules = [a["rule"] for a in alerts]
  assert {"nonfinite_router_input", "nonfinite_step"} <= set(rules)
  assert "fallback_ran" not in rules
  [skip] = [a for a in alerts if a["rule"] == "nonfinite_step"][:1]
  assert skip["data_position"]["step"] == skip["step"] == 0
  assert len(skip["data_position"]["rows"]) == c.data.batch_size
  saved = _restored_state(settings_of(c), str(tmp_path))
  assert int(saved.step) == 4
  jax.tree.map(np.testing.assert_array_equal, (saved.params, saved.opt_state),
               (initial["state"].params, initial["state"].opt_state))
  assert sorted(os.listdir(tmp_path / "checkpoints")) == ["1", "4"]


def test_a_spike_is_judged_only_from_min_steps_applied_steps_on():
  """A window of 16 (16 // 8 = 2 < MIN_STEPS = 4): with three applied steps a loss 100x
  theirs is no spike (no basis yet); with four it is, against the window's mean and sample
  deviation computed here with numpy."""
  assert spikes_lib.MIN_STEPS == 4
  window, losses = spikes_lib.empty(16), [1.0, 1.2, 0.9, 1.1]
  for i, loss in enumerate(losses):
    judged = spikes_lib.check(window, jnp.float32(100.0), jnp.float32(1.0), sigma=6.0)
    assert not bool(judged.spike), i  # i applied steps: below the 4 of the contract
    window = spikes_lib.push(window, jnp.float32(loss), jnp.float32(1.0), jnp.bool_(True))
  judged = spikes_lib.check(window, jnp.float32(100.0), jnp.float32(1.0), sigma=6.0)
  assert bool(judged.spike)
  np.testing.assert_allclose(judged.mean, [np.mean(losses), 1.0], rtol=1e-6)
  np.testing.assert_allclose(judged.std, [np.std(losses, ddof=1), 0.0], rtol=1e-5, atol=1e-7)
  # Not a spike within sigma deviations of the mean.
  assert not bool(spikes_lib.check(window, jnp.float32(1.3), jnp.float32(1.0), 6.0).spike)
