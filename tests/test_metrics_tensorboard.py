"""MoE metrics end to end: model step -> callbacks -> CLU event files -> TensorBoard."""
import json
import os
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request

import jax
import numpy as np
import pytest

import metrics
import moe_hk
from metrics import expert_load, writer as writer_lib
from metrics.evidence import Evidence
from metrics.factor_rule import Rule
from metrics.event_files import has_hparams, read_histograms, read_images, read_scalars
from moe_hk import buffer_size
from tests.helpers import BASE, MESH_SHAPE, ROOT, free_port, unrolled_model
from tests.moe_inputs import skewed_inputs

# The tests share the module's trained run (one worker: tests/conftest.py WORKER_GROUPS).


STEPS = 3


@pytest.fixture(scope="module")
def trained_logdir(tmp_path_factory):
  """Three steps of a 3-layer model (fallback, drops, worst case) with MoEMetrics on, a
  different batch every step (so values written under the wrong step would not match)."""
  workdir = str(tmp_path_factory.mktemp("run"))
  mesh = moe_hk.make_mesh(**MESH_SHAPE)
  batches = [skewed_inputs(moe_hk.MoEConfig(**BASE), 16, 16, skew=3.0, seed=1 + step)[1]
             for step in range(STEPS)]
  model = unrolled_model(mesh)
  params, state = jax.jit(model.init)(jax.random.key(0), batches[0], 0)
  step_fn = jax.jit(lambda p, s, xx, step: model.apply(p, s, None, xx, step))
  alerts, returned, reported = [], [], []
  worst = buffer_size.worst_case_factor(8, 2, 4)
  evidence = Evidence(worst_case=worst, window=2, rule=Rule(min_steps=1))
  manager = metrics.AlertManager(worst_case_factor=worst, workdir=workdir,
                                 callback=alerts.append)
  with metrics.MoEMetrics(workdir, worst_case_factor=worst, evidence=evidence, alerts=manager,
                          hparams={"ragged_buffer_factor": 0.5},
                          flush_on_sigterm=False) as moe_metrics:
    for step in range(STEPS):
      _, new_state = step_fn(params, state, batches[step], step)
      returned.append(new_state)
      reported.append(moe_metrics.end_step(step, dropless_steps=0,
                                           extra_scalars={"train/loss": 1.0}))
    # The image of the interval: the sum of the returned rows per expert.
    moe_metrics.writer.write_expert_load(STEPS - 1, np.stack([
        sum(np.asarray(s[f"moe_{i}"]["stats"].tokens_per_expert) for s in returned)
        for i in range(3)]))
  return workdir, returned, reported, alerts


def _layer_stats(state):
  return [state[f"moe_{i}"]["stats"] for i in range(3)]


def test_event_files_hold_the_tags_with_the_returned_values(trained_logdir):
  workdir, returned, reported, _ = trained_logdir
  scalars = read_scalars(workdir)
  per_layer = [writer_lib.REQUIRED_FACTOR_TAG, writer_lib.LOAD_MAX_OVER_MEAN_TAG,
               writer_lib.DEAD_EXPERTS_TAG, writer_lib.ROUTER_ENTROPY_TAG,
               writer_lib.FALLBACK_CHUNKS_TAG]
  for tag in [writer_lib.FALLBACK_LAYERS_TAG, writer_lib.FREQUENCY_TAG,
              writer_lib.REQUIRED_FACTOR_TAG, writer_lib.DROPPED_FRACTION_TAG,
              writer_lib.RECOMMENDED_FACTOR_TAG, writer_lib.DROPLESS_STEPS_TAG,
              writer_lib.LB_LOSS_TAG, writer_lib.Z_LOSS_TAG,
              *(f"{t}/layer_{i}" for t in per_layer for i in range(3)), "train/loss"]:
    assert sorted(scalars[tag]) == list(range(STEPS)), tag
  for step, state in enumerate(returned):
    stats = _layer_stats(state)
    assert scalars[writer_lib.FALLBACK_LAYERS_TAG][step] == sum(int(s.fallback) for s in stats)
    for i, s in enumerate(stats):
      tpe = np.asarray(s.tokens_per_expert)
      expected = {writer_lib.REQUIRED_FACTOR_TAG: s.required_factor,
                  writer_lib.LOAD_MAX_OVER_MEAN_TAG: tpe.max() / tpe.mean(),
                  writer_lib.DEAD_EXPERTS_TAG: np.sum(tpe == 0),
                  writer_lib.ROUTER_ENTROPY_TAG: s.router_entropy,
                  writer_lib.FALLBACK_CHUNKS_TAG: s.fallback_chunks}
      for tag, value in expected.items():
        np.testing.assert_allclose(scalars[f"{tag}/layer_{i}"][step], value, rtol=1e-6,
                                   err_msg=f"{tag}/layer_{i} at step {step}")
    np.testing.assert_allclose(scalars[writer_lib.REQUIRED_FACTOR_TAG][step],
                               max(float(s.required_factor) for s in stats), rtol=1e-6)
    routed = sum(int(s.tokens_per_expert.sum()) for s in stats)
    np.testing.assert_allclose(scalars[writer_lib.DROPPED_FRACTION_TAG][step],
                               sum(int(s.dropped_rows) for s in stats) / routed, rtol=1e-6)
    for tag, field in ((writer_lib.LB_LOSS_TAG, "lb_loss"), (writer_lib.Z_LOSS_TAG, "z_loss")):
      np.testing.assert_allclose(scalars[tag][step],
                                 sum(float(getattr(s, field)) for s in stats), rtol=1e-6)
  # Each step routed its own batch: the values differ from step to step.
  layer_0 = [scalars[f"{writer_lib.REQUIRED_FACTOR_TAG}/layer_0"][s] for s in range(STEPS)]
  assert len(set(layer_0)) == STEPS, layer_0
  assert scalars[writer_lib.FALLBACK_CHUNKS_TAG + "/layer_0"][0] > 0  # layer 0 fell back
  assert scalars[writer_lib.FALLBACK_CHUNKS_TAG + "/layer_1"][0] == 0  # layer 1 dropped
  assert scalars[writer_lib.FREQUENCY_TAG][2] == 1.0  # layer 0 falls back every step
  assert has_hparams(workdir)


def test_histograms_hold_the_rows_per_expert(trained_logdir):
  """Each step's histogram of rows per expert: its bucket counts are the returned
  `tokens_per_expert` binned over [min, max] (TensorBoard's bucketing), step by step."""
  workdir, returned, _, _ = trained_logdir
  histograms = read_histograms(workdir)
  for i in range(3):
    events = histograms[f"{writer_lib.TOKENS_PER_EXPERT_TAG}/layer_{i}"]
    assert sorted(events) == list(range(STEPS))
    for step, state in enumerate(returned):
      tpe = np.asarray(_layer_stats(state)[i].tokens_per_expert, np.float64)
      buckets = events[step]  # [n, (left edge, right edge, count)]
      assert buckets[0, 0] == tpe.min() and buckets[-1, 1] == tpe.max()
      edges = np.append(buckets[:, 0], buckets[-1, 1])
      np.testing.assert_array_equal(buckets[:, 2], np.histogram(tpe, bins=edges)[0])


def test_expert_load_image(trained_logdir):
  """`moe/expert_load`: the layer-by-expert heatmap of the interval's rows over the fair
  share, read back from the event file: each cell's colour is there (metrics.expert_load)."""
  import matplotlib
  workdir, returned, _, _ = trained_logdir
  image = read_images(workdir)[writer_lib.EXPERT_LOAD_TAG][STEPS - 1][..., :3]
  assert image.shape[1] == expert_load.WIDTH_PIXELS
  load = np.stack([sum(np.asarray(s[f"moe_{i}"]["stats"].tokens_per_expert) for s in returned)
                   for i in range(3)])
  cmap = matplotlib.colormaps[expert_load.COLORMAP]
  cells = cmap(expert_load.relative_load(load) / expert_load.LOAD_RANGE[1], bytes=True)
  colours = {tuple(int(c) for c in pixel) for pixel in image.reshape(-1, 3)}
  missing = [tuple(int(c) for c in rgb[:3]) for rgb in cells.reshape(-1, 4)
             if tuple(int(c) for c in rgb[:3]) not in colours]
  assert not missing, missing


def test_alerts_from_a_real_run(trained_logdir):
  workdir, returned, reported, alerts = trained_logdir
  rules = {a.rule for a in alerts}
  assert {"fallback_ran", "rows_dropped"} <= rules
  with open(os.path.join(workdir, "alerts.jsonl")) as f:
    lines = [json.loads(line) for line in f]
  assert len(lines) == len(alerts)
  fallback = next(a for a in alerts if a.rule == "fallback_ran")
  assert fallback.details["layers"] == [0] and fallback.step == 0
  assert fallback.details["recommended_ragged_buffer_factor"] >= reported[0].required_factor
  # Where: the receiving expert shards that overflowed and the three hottest experts.
  stats = _layer_stats(returned[0])[0]
  receivers = np.flatnonzero(stats.receiver_overflow_rows).tolist()
  hot = np.argsort(-np.asarray(stats.tokens_per_expert), kind="stable")[:3].tolist()
  assert receivers and fallback.details["hotspots"] == [{"layer": 0, "receivers": receivers,
                                                         "hot_experts": hot}]
  assert f"expert shards {receivers} overflowed, hottest experts {hot}" in fallback.message
  assert lines[alerts.index(fallback)]["hotspots"] == fallback.details["hotspots"]


def _get_json(url):
  with urllib.request.urlopen(url, timeout=5) as response:
    return json.loads(response.read())


@pytest.mark.slow
def test_tensorboard_server_serves_the_scalars(trained_logdir):
  workdir, returned, _, _ = trained_logdir
  port = free_port()
  server = subprocess.Popen(
      [sys.executable, "-m", "tensorboard.main", "--logdir", workdir, "--host", "127.0.0.1",
       "--port", str(port), "--reload_interval", "1"],
      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  base = f"http://127.0.0.1:{port}"
  try:
    tag = urllib.parse.quote(writer_lib.FALLBACK_LAYERS_TAG, safe="")
    deadline, points = time.time() + 90, None
    while time.time() < deadline:
      try:
        runs = _get_json(f"{base}/data/runs")
        if runs:
          points = _get_json(f"{base}/data/plugin/scalars/scalars?run={runs[0]}&tag={tag}")
          if len(points) == 3:
            break
      except (OSError, ValueError):
        pass
      time.sleep(1)
    assert points is not None and len(points) == 3, points
    assert [p[1] for p in points] == [0, 1, 2]
    assert [p[2] for p in points] == [int(s["moe_0"]["stats"].fallback) +
                                      int(s["moe_1"]["stats"].fallback) for s in returned]
  finally:
    server.terminate()
    server.wait(timeout=30)


_SIGTERM_SCRIPT = """
import sys, time
from metrics.writer import MoEMetricsWriter
writer = MoEMetricsWriter(sys.argv[1])
if sys.argv[2] == "handler":
  writer.flush_on_sigterm()
for step in range(5):
  writer.write_scalars(step, {"moe/fallback_frequency": step / 10})
print("ready", flush=True)
time.sleep(120)
"""


@pytest.mark.parametrize("handler", [True, False])
def test_reported_metrics_survive_sigterm(tmp_path, handler):
  """With the handler every scalar written before SIGTERM is in the event file; the control
  without it loses them (the writer buffers), so the handler is what saves them."""
  proc = subprocess.Popen(
      [sys.executable, "-c", _SIGTERM_SCRIPT, str(tmp_path), "handler" if handler else "none"],
      cwd=ROOT, stdout=subprocess.PIPE, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert proc.stdout.readline().strip() == "ready"
  proc.send_signal(signal.SIGTERM)
  assert proc.wait(timeout=180) == -signal.SIGTERM  # generous: the suite loads the machine
  written = read_scalars(str(tmp_path)).get("moe/fallback_frequency", {})
  if handler:
    assert written == {s: pytest.approx(s / 10) for s in range(5)}
  else:
    assert len(written) < 5, written
