"""MoE metrics end to end: model step -> callbacks -> CLU event files -> TensorBoard."""
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request

import jax
import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.util import tensor_util

import metrics
import moe_hk
from metrics import writer as writer_lib
from tests.moe_inputs import skewed_inputs
from tests.test_metrics_events import BASE, MESH_SHAPE, _unrolled_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def read_scalars(logdir):
  """tag -> {step: value} from the event files in `logdir`."""
  acc = EventAccumulator(logdir, size_guidance={"tensors": 0})
  acc.Reload()
  return {tag: {e.step: tensor_util.make_ndarray(e.tensor_proto).item()
                for e in acc.Tensors(tag)} for tag in acc.Tags()["tensors"]
          if acc.SummaryMetadata(tag).plugin_data.plugin_name == "scalars"}


@pytest.fixture(scope="module")
def trained_logdir(tmp_path_factory):
  """Three steps of a 3-layer model (fallback, drops, worst case) with MoEMetrics on."""
  workdir = str(tmp_path_factory.mktemp("run"))
  mesh = moe_hk.make_mesh(**MESH_SHAPE)
  _, x = skewed_inputs(moe_hk.MoEConfig(**BASE), 16, 16, skew=3.0, seed=1)
  model = _unrolled_model(mesh)
  params, state = jax.jit(model.init)(jax.random.key(0), x, 0)
  step_fn = jax.jit(lambda p, s, xx, step: model.apply(p, s, None, xx, step))
  alerts, returned, reported = [], [], []
  with metrics.MoEMetrics(workdir, worst_case_factor=metrics.worst_case_factor(8, 2, 4),
                          alert_callback=alerts.append, window=2,
                          hparams={"ragged_buffer_factor": 0.5},
                          flush_on_sigterm=False) as moe_metrics:
    for step in range(3):
      _, new_state = step_fn(params, state, x * (1 + step), step)
      returned.append(new_state)
      reported.append(moe_metrics.end_step(step, replays=0, extra_scalars={"train/loss": 1.0}))
  return workdir, returned, reported, alerts


def test_event_files_hold_the_tags_with_the_returned_values(trained_logdir):
  workdir, returned, reported, _ = trained_logdir
  scalars = read_scalars(workdir)
  for tag in [writer_lib.FALLBACK_LAYERS_TAG, writer_lib.FREQUENCY_TAG,
              writer_lib.REQUIRED_FACTOR_TAG, writer_lib.DROPPED_FRACTION_TAG,
              writer_lib.RECOMMENDED_FACTOR_TAG, writer_lib.STEP_REPLAYS_TAG,
              *(f"{writer_lib.REQUIRED_FACTOR_TAG}/layer_{i}" for i in range(3)), "train/loss"]:
    assert sorted(scalars[tag]) == [0, 1, 2], tag
  for step, state in enumerate(returned):
    stats = [state[f"moe_{i}"]["stats"] for i in range(3)]
    assert scalars[writer_lib.FALLBACK_LAYERS_TAG][step] == sum(int(s.fallback) for s in stats)
    for i, s in enumerate(stats):
      np.testing.assert_allclose(
          scalars[f"{writer_lib.REQUIRED_FACTOR_TAG}/layer_{i}"][step], s.required_factor,
          rtol=1e-6)
    np.testing.assert_allclose(scalars[writer_lib.REQUIRED_FACTOR_TAG][step],
                               max(float(s.required_factor) for s in stats), rtol=1e-6)
    routed = sum(int(s.tokens_per_expert.sum()) for s in stats)
    np.testing.assert_allclose(scalars[writer_lib.DROPPED_FRACTION_TAG][step],
                               sum(int(s.dropped_rows) for s in stats) / routed, rtol=1e-6)
  assert scalars[writer_lib.FREQUENCY_TAG][2] == 1.0  # layer 0 falls back every step
  acc = EventAccumulator(workdir, size_guidance={"tensors": 0})
  acc.Reload()
  assert any(t.startswith("_hparams_") for t in acc.Tags()["tensors"])
  for i in range(3):
    stats = returned[-1][f"moe_{i}"]["stats"]
    tag = f"{writer_lib.TOKENS_PER_EXPERT_TAG}/layer_{i}"
    assert acc.SummaryMetadata(tag).plugin_data.plugin_name == "histograms"
    buckets = tensor_util.make_ndarray(acc.Tensors(tag)[-1].tensor_proto)  # [n, (lo, hi, count)]
    assert buckets[:, 2].sum() == stats.tokens_per_expert.size  # one entry per expert


def test_alerts_from_a_real_run(trained_logdir):
  workdir, _, reported, alerts = trained_logdir
  rules = {a.rule for a in alerts}
  assert {"fallback_ran", "rows_dropped"} <= rules
  with open(os.path.join(workdir, "alerts.jsonl")) as f:
    lines = [json.loads(line) for line in f]
  assert len(lines) == len(alerts)
  fallback = next(a for a in alerts if a.rule == "fallback_ran")
  assert fallback.layers == [0] and fallback.step == 0
  assert fallback.recommended_ragged_buffer_factor >= reported[0].required_factor


def _free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _get_json(url):
  with urllib.request.urlopen(url, timeout=5) as response:
    return json.loads(response.read())


@pytest.mark.slow
def test_tensorboard_server_serves_the_scalars(trained_logdir):
  workdir, returned, _, _ = trained_logdir
  port = _free_port()
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
writer.flush_on_sigterm()
for step in range(5):
  writer.write_scalars(step, {"moe/fallback_frequency": step / 10})
print("ready", flush=True)
time.sleep(120)
"""


def test_reported_metrics_survive_sigterm(tmp_path):
  proc = subprocess.Popen([sys.executable, "-c", _SIGTERM_SCRIPT, str(tmp_path)], cwd=ROOT,
                          stdout=subprocess.PIPE, text=True,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert proc.stdout.readline().strip() == "ready"
  proc.send_signal(signal.SIGTERM)
  assert proc.wait(timeout=60) == -signal.SIGTERM
  assert read_scalars(str(tmp_path))["moe/fallback_frequency"] == {
      s: pytest.approx(s / 10) for s in range(5)}
