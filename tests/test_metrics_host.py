"""Host-side aggregation, alert rules and the writer's owner, driven by synthetic layer events."""
import glob
import json
import random
import re
import sys
import threading

import numpy as np
import pytest

from metrics import Aggregator, AlertConfig, AlertManager, MoEMetrics, MoEMetricsWriter
from metrics.evidence import Evidence
from metrics.factor_rule import Rule
from metrics.event_files import read_scalars
from metrics import expert_load, tags
from metrics.run_folder import run_dir
from metrics.step_summaries import png_size
from metrics.writer import DROPLESS_STEPS_TAG
from moe_hk import MoEStats
from moe_hk.events import FALLBACK_EVENT, STEP_STATS_EVENT, LayerEvent


def _event(step, layer, process=0, fallback=0, factor=1.0, would_drop=0, dropped=0,
           tokens=(4, 4, 4, 4), nonfinite=0):
  stats = MoEStats(
      fallback=np.int32(fallback), required_factor=np.float32(factor),
      would_drop_rows=np.int32(would_drop), dropped_rows=np.int32(dropped),
      tokens_per_expert=np.asarray(tokens, np.int32), nonfinite_tokens=np.int32(nonfinite),
      lb_loss=np.float32(0.01),
      z_loss=np.float32(0.001), fallback_chunks=np.int32(2 * fallback),
      router_entropy=np.float32(1.0),
      receiver_overflow_rows=np.asarray([would_drop, 0], np.int32),  # all on expert shard 0
      routed_rows_per_device=np.zeros((0, len(tokens)), np.int32))   # traffic not recorded
  return LayerEvent(FALLBACK_EVENT if fallback else STEP_STATS_EVENT, step, layer, process, stats)


def test_duplicates_collapse_to_one_record_per_layer_and_remember_processes():
  agg = Aggregator()
  for process in range(8):
    for _ in range(2):  # remat: a second pass
      agg(_event(3, 0, process, fallback=1, factor=2.5, would_drop=7))
      agg(_event(3, 1, process, factor=0.75))
  m = agg.finish_step(3)
  assert sorted(m.layers) == [0, 1]
  assert m.layers[0].processes == frozenset(range(8))
  assert m.fallback_layers == 1 and m.required_factor == 2.5
  assert m.layers[0].would_drop_rows == 7 and m.layers[0].routed_rows == 16


def test_dropped_fraction_frequency_and_recommended_factor():
  """Without step timings the rule names the smallest candidate (multiples of 1/8) whose
  replayed fallback frequency is at most the target: the window's required factors decide."""
  agg = Aggregator(Evidence(worst_case=8.0, window=4, rule=Rule(target=0.25, min_steps=1)))
  history = [(1.0, 0), (3.0, 1), (2.0, 0), (5.0, 1), (1.5, 0)]
  for step, (factor, fell_back) in enumerate(history):
    agg(_event(step, 0, fallback=fell_back, factor=factor, dropped=2 * (1 - fell_back)))
    m = agg.finish_step(step)
  # The window holds the last 4 steps: factors 3, 2, 5, 1.5 and fallbacks 1, 0, 1, 0.
  assert m.fallback_frequency == 0.5
  # At 3.0 only the step needing 5.0 falls back (1 of 4 <= 25%); at 2.875 two do.
  assert m.recommended_factor == 3.0 and m.advice.basis == "frequency"
  assert m.advice.reason == ("use ragged_buffer_factor=3: the smallest factor that would have "
                             "fallen back on at most 25% of the last 4 steps (1); it was never "
                             "timed.")
  assert m.dropped_rows_fraction == 2 / 16


@pytest.mark.parametrize("required,recommended", [
    (3.703125, 3.75),  # the default job's step 9: 3.7 would hold 1,894 rows of the 1,896
    (3.75, 3.75),      # a layer needing exactly the factor's rows fits it
    (3.751953125, 3.875)])  # 3.75 + 2^-9, exact in float32
def test_the_recommendation_covers_the_steps_it_claims(required, recommended):
  """The recommended factor, replayed on the window, really avoids the fallback on the steps
  the message says: a required factor just above a multiple of 0.05 (or of 1/8) is covered
  by the next candidate up, never rounded below it."""
  agg = Aggregator(Evidence(worst_case=4.0, window=10, rule=Rule(min_steps=1)))
  for step, factor in enumerate([1.5, 2.0, required, 1.8]):
    agg(_event(step, 0, factor=factor))
    m = agg.finish_step(step)
  assert m.recommended_factor == recommended
  assert m.recommended_factor >= required  # at it the layer overflows only if required > it
  assert (f"ragged_buffer_factor={recommended:g}: the smallest factor that would have fallen "
          "back on at most 1% of the last 4 steps (0)") in m.advice.reason


def test_late_events_are_ignored_and_open_steps_bounded():
  agg = Aggregator(max_open_steps=3)
  agg(_event(1, 0))
  agg.finish_step(1)
  agg(_event(1, 0))
  assert agg.late_events == 1
  for step in range(10, 20):
    agg(_event(step, 0))
  assert agg.evicted_steps == 7 and agg.finish_step(19) is not None
  assert agg.finish_step(25) is None


PROCESSES, LAYERS, STEPS = 8, 3, 300


def _reports(process, step, layer):
  """Which processes report a (step, layer): a different subset for each."""
  return (process + step + layer) % 3 != 0


def _fell_back(step, layer):
  """(step, layer)s whose fallback ran; the others drop rows."""
  return (step + layer) % 4 == 0


def _process_events(process, steps):
  """One process's events for `steps`: two passes (remat) of each (step, layer) it reports."""
  events = []
  for step in steps:
    for layer in range(LAYERS):
      if not _reports(process, step, layer):
        continue
      fell_back = _fell_back(step, layer)
      events += 2 * [_event(step, layer, process, fallback=int(fell_back),
                            factor=step + layer / 4, dropped=0 if fell_back else layer + 1,
                            would_drop=layer + 1)]
  return events


def _shuffled(events, seed):
  """`events` roughly in step order (so all threads contend for the same few steps), in a
  random order within a step. Steps `STEPS` apart are mixed together."""
  rng = random.Random(seed)
  return sorted(events, key=lambda e: (e.step % STEPS, rng.random()))


def _send_concurrently(agg, per_process):
  """Every process's events from its own thread, all released at once by a barrier."""
  barrier = threading.Barrier(len(per_process))
  def send(events):
    barrier.wait()
    for e in events:
      agg(e)
  threads = [threading.Thread(target=send, args=(events,)) for events in per_process]
  for t in threads:
    t.start()
  for t in threads:
    t.join()


def _assert_exact_records(agg, steps):
  """Finishes `steps` and checks one record per (step, layer) as the dedup rule defines it."""
  for step in steps:
    m = agg.finish_step(step)
    assert sorted(m.layers) == list(range(LAYERS)), step
    for layer, record in m.layers.items():
      fell_back = _fell_back(step, layer)
      reporters = {p for p in range(PROCESSES) if _reports(p, step, layer)}
      assert record.processes == frozenset(reporters), (step, layer)
      assert record.fallback == fell_back, (step, layer)
      assert record.dropped_rows == (0 if fell_back else layer + 1), (step, layer)
      assert record.required_factor == step + layer / 4, (step, layer)
    assert m.fallback_layers == sum(_fell_back(step, layer) for layer in range(LAYERS))


def test_thread_safe_under_concurrent_callbacks():
  """8 process threads start together and switch every microsecond, so their calls really
  interleave (over a thousand events each, twice); the outcome must be exactly the serial one."""
  steps = range(STEPS)
  agg = Aggregator(max_open_steps=STEPS)
  interval = sys.getswitchinterval()
  sys.setswitchinterval(1e-6)
  try:
    first = [_shuffled(_process_events(s, steps), s) for s in range(PROCESSES)]
    _send_concurrently(agg, first)
    _assert_exact_records(agg, steps)
    # Every event of the finished steps again, interleaved with the next steps' events: each
    # late one is counted, none reopens its step, and the new steps come out exact.
    later = range(STEPS, 2 * STEPS)
    _send_concurrently(agg, [_shuffled(old + _process_events(s, later), PROCESSES + s)
                             for s, old in enumerate(first)])
  finally:
    sys.setswitchinterval(interval)
  assert agg.late_events == sum(map(len, first))
  assert all(agg.finish_step(step) is None for step in steps)
  _assert_exact_records(agg, later)
  assert agg.evicted_steps == 0


class _Steps:
  """Finished steps of a two-layer model whose layer 0 is described by the keywords (layer
  1's by `layer1`); the factor rule weighs 10 steps and names a factor from 5 on."""

  def __init__(self, factor: float | None = None):
    self.aggregator = Aggregator(Evidence(worst_case=None, factor=factor, window=10,
                                          rule=Rule(min_steps=5)))

  def __call__(self, step, layer1=None, **layer0):
    self.aggregator(_event(step, 0, **layer0))
    self.aggregator(_event(step, 1, **(layer1 or dict(factor=0.5))))
    return self.aggregator.finish_step(step)


@pytest.fixture
def manager(tmp_path):
  received = []
  m = AlertManager(worst_case_factor=4.0, workdir=str(tmp_path), callback=received.append,
                   config=AlertConfig(frequency_threshold=0.3, near_worst_fraction=0.9,
                                      min_steps_between=5))
  return m, received, tmp_path / "alerts.jsonl", _Steps()


def test_quiet_steps_raise_no_alert(manager):
  m, received, path, steps = manager
  for step in range(20):
    assert m.check(steps(step, factor=1.2)) == []
  assert received == [] and not path.exists()


def test_fallback_alert_is_rate_limited_and_written(manager):
  m, received, path, steps = manager
  fired = [step for step in range(12)
           if any(a.rule == "fallback_ran" for a in m.check(steps(step, fallback=1,
                                                                    factor=2.3, would_drop=3)))]
  assert fired == [0, 5, 10]
  lines = [json.loads(line) for line in path.read_text().splitlines()]
  first = lines[0]
  assert set(first) == {"time", "step", "rule", "layers", "hotspots", "since", "frequency",
                        "required_factor", "recommended_ragged_buffer_factor", "message"}
  # Layer 0's rows beyond the buffer all went to expert shard 0; every expert got 4 rows.
  assert first["hotspots"] == [{"layer": 0, "receivers": [0], "hot_experts": [0, 1, 2]}]
  assert first["rule"] == "fallback_ran" and first["layers"] == [0] and first["step"] == 0
  later = [a for a in received if a.rule == "fallback_ran"][-1]
  assert later.details["since"] == 0 and later.step == 10
  assert later.details["recommended_ragged_buffer_factor"] == pytest.approx(2.3)
  assert "ragged_buffer_factor=2.3" in later.message


def test_frequency_rule_fires_above_threshold_only(manager):
  m, received, _, steps = manager
  for step in range(10):  # 2 fallbacks in 10 steps: 20% < 30%
    m.check(steps(step, fallback=int(step in (3, 7)), factor=1.8))
  assert not [a for a in received if a.rule == "frequent_fallback"]
  for step in range(10, 14):  # 4 more: 5 of the last 10
    m.check(steps(step, fallback=1, factor=1.8))
  frequent = [a for a in received if a.rule == "frequent_fallback"]
  assert frequent and frequent[0].details["frequency"] > 0.3
  for step in range(14, 20):  # no fallback, but still over 30% of the last 10 steps
    m.check(steps(step, fallback=0, factor=1.2))
  quiet = [a for a in received if a.rule == "frequent_fallback" and a.step >= 14]
  assert quiet and quiet[0].details["layers"] == [], quiet
  frequency = f"{quiet[0].details['frequency']:.0%}"
  assert f"the MoE layers overflowed on {frequency} of recent steps" in quiet[0].message
  assert "(none at this step)" in quiet[0].message and "layers []" not in quiet[0].message


def test_fallback_ran_describes_the_whole_step(manager):
  """Both layers fell back: the alert names both and the step's required factor (the maximum
  over layers), as the step's `learning/moe_dropless_fallback_layers` and
  `moe/required_ragged_buffer_factor` points say."""
  m, received, _, steps = manager
  step = steps(0, fallback=1, factor=2.31, would_drop=3,
               layer1=dict(fallback=1, factor=3.39, would_drop=5))
  [alert] = [a for a in m.check(step) if a.rule == "fallback_ran"]
  assert step.fallback_layers == 2 and step.required_factor == pytest.approx(3.39)
  assert alert.details["layers"] == [0, 1]
  assert alert.details["required_factor"] == pytest.approx(3.39)
  assert "layers [0, 1] ran the dropless fallback" in alert.message
  assert "required factor 3.39" in alert.message


def test_no_frequency_alert_or_recommendation_below_the_minimum_window(manager):
  """Every step falls back: below the rule's 5 steps nothing is recommended and no
  frequent_fallback fires (one step is no frequency); from the 5th step on both are there."""
  m, received, _, steps = manager
  for step in range(4):
    metrics = steps(step, fallback=1, factor=1.8)
    assert metrics.recommended_factor is None
    assert metrics.advice.reason == f"{step + 1} of 5 steps of evidence: too few to name a " \
                                    "factor yet."
    assert "frequent_fallback" not in {a.rule for a in m.check(metrics)}
  metrics = steps(4, fallback=1, factor=1.8)
  assert metrics.recommended_factor == pytest.approx(1.8)
  assert "frequent_fallback" in {a.rule for a in m.check(metrics)}


def test_a_recommendation_of_the_factor_in_force_reads_keep():
  steps = _Steps(factor=2.0)
  for step in range(6):
    metrics = steps(step, factor=1.9)
  assert metrics.recommended_factor == 2.0 and metrics.advice.keep
  assert metrics.advice.reason.startswith("keep ragged_buffer_factor=2: the smallest factor")
  other = _Steps(factor=3.0)
  for step in range(6):
    metrics = other(step, factor=1.9)
  assert metrics.advice.reason.startswith("use ragged_buffer_factor=2:")


def test_drop_and_near_worst_case_rules(manager):
  """near_worst_case needs the required factor near the worst case on `near_worst_steps` (10)
  steps in a row: the untrained router's transient (3 such steps in the default job) raises
  nothing; a collapsed router does, once, and a step below the margin ends the run."""
  m, received, _, steps = manager
  rules = {a.rule for a in m.check(steps(0, dropped=4, would_drop=4, factor=3.7))}
  assert rules == {"rows_dropped"}
  for step, factor in zip(range(1, 4), (3.8, 3.65, 3.5)):  # 3.5 < 0.9 * 4
    assert not any(a.rule == "near_worst_case" for a in m.check(steps(step, factor=factor)))
  fired = [step for step in range(4, 20)
           if any(a.rule == "near_worst_case" for a in m.check(steps(step, factor=4.0)))]
  assert fired == [13, 18]  # the 10th step in a row, then rate-limited (every 5 steps)
  [alert] = [a for a in received if a.rule == "near_worst_case"][:1]
  assert alert.details["since"] == 13 and "on 10 steps in a row" in alert.message


def test_one_expert_shard_is_never_near_its_worst_case(tmp_path):
  """One expert shard: its worst case is the balanced load (factor 1), so every step's
  required factor is "at" it; near_worst_case does not apply. A fallback at factor 0.75 still
  alerts, naming the overflowing shard."""
  received = []
  m = AlertManager(worst_case_factor=1.0, callback=received.append,
                   config=AlertConfig(near_worst_steps=2, min_steps_between=1))
  steps = _Steps()
  for step in range(6):
    m.check(steps(step, fallback=1, factor=1.0, would_drop=3, layer1=dict(factor=1.0)))
  assert {a.rule for a in received} == {"fallback_ran", "frequent_fallback"}, received


def test_no_message_lists_an_empty_set_of_shards(manager):
  """A layer named by a rule without an overflowing receiver at this step (near the worst case
  within the buffer) is described by its hottest experts alone."""
  m, received, _, steps = manager
  for step in range(10):
    m.check(steps(step, factor=3.8))
  [alert] = [a for a in received if a.rule == "near_worst_case"]
  assert alert.details["hotspots"][0]["receivers"] == []
  assert "[]" not in alert.message and "layer 0: hottest experts [0, 1, 2]" in alert.message


def test_nonfinite_router_input_alert_is_rate_limited_and_blames_no_expert(manager):
  """Non-finite router input is bad data, not traffic: its own rule, with the layers and their
  counts, no hotspots, and none of the overflow rules."""
  m, received, path, steps = manager
  fired = [step for step in range(12) if m.check(steps(step, nonfinite=3, factor=1.2))]
  assert fired == [0, 5, 10]
  assert {a.rule for a in received} == {"nonfinite_router_input"}
  first = json.loads(path.read_text().splitlines()[0])
  assert first["rule"] == "nonfinite_router_input" and first["step"] == 0
  assert first["layers"] == [0] and first["nonfinite_tokens"] == [3]
  assert first["hotspots"] == [] and first["since"] == 0
  assert "step 0" in first["message"] and "layer 0: 3" in first["message"]
  assert first["message"].startswith("MoE non-finite router input [nonfinite_router_input]")
  assert received[-1].details["since"] == 0 and received[-1].step == 10
  assert m.check(steps(12, factor=1.2)) == []  # finite again: the condition's run ends
  assert [a.details["since"] for a in m.check(steps(20, nonfinite=1, factor=1.2))] == [20]


def test_nonfinite_tokens_tag_every_step():
  """`moe/nonfinite_tokens/layer_<i>`, zeros included (CLU loads TensorFlow: imported here)."""
  from metrics.writer import NONFINITE_TOKENS_TAG, step_scalars
  steps = _Steps()
  scalars = step_scalars(steps(0, nonfinite=5))
  assert NONFINITE_TOKENS_TAG == "moe/nonfinite_tokens"
  assert scalars["moe/nonfinite_tokens/layer_0"] == 5
  assert scalars["moe/nonfinite_tokens/layer_1"] == 0


def test_a_writer_passed_in_stays_open_for_its_owner(tmp_path):
  """The trainer's route: its writer takes the MoE tags and its own scalars, in one set of
  event files; closing MoEMetrics leaves that writer open, its owner closes it."""
  workdir = str(tmp_path)
  one_layer = type(_event(0, 0).stats)(*(np.asarray(f)[None] for f in _event(0, 0).stats))
  with MoEMetricsWriter(workdir, asynchronous=False) as writer:
    with MoEMetrics(workdir, worst_case_factor=4.0, writer=writer,
                    flush_on_sigterm=False) as moe_metrics:
      assert moe_metrics.writer is writer
      moe_metrics.report_step(0, one_layer, dropless_steps=1)
    writer.write_scalars(0, {"train/loss": 2.0})  # after MoEMetrics closed
  scalars = read_scalars(workdir)
  assert scalars[DROPLESS_STEPS_TAG] == {0: 1.0} and scalars["train/loss"] == {0: 2.0}
  assert len(glob.glob(f"{workdir}/events.out.tfevents.*")) == 1


def test_the_background_writer_keeps_order_bounds_its_lag_and_reports_a_failed_write(tmp_path):
  """Writes queued behind `flush(wait=False)` all reach the event file by `close()`; a write
  that failed on the writer's thread raises from the next call instead of vanishing."""
  workdir = str(tmp_path)
  writer = MoEMetricsWriter(workdir, max_behind=1)
  for step in range(30):
    writer.write_scalars(step, {"train/loss": float(step)})
    if step % 3 == 2:  # three steps a flush
      writer.flush(wait=False)
    assert len(writer._flushes) <= 1  # never more than max_behind flushes outstanding
  writer.close()
  assert read_scalars(workdir)["train/loss"] == {s: float(s) for s in range(30)}
  # In the file, in the order written (the dict above cannot show order).
  from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
  (path,) = glob.glob(f"{workdir}/events.out.tfevents.*")
  written = [e.step for e in EventFileLoader(path).Load()
             if any(v.tag == "train/loss" for v in e.summary.value)]
  assert written == list(range(30)), written

  broken = MoEMetricsWriter(str(tmp_path / "broken"))
  broken.write_scalars(0, {"train/loss": "not a number"})
  with pytest.raises(RuntimeError, match="writing metrics failed"):
    broken.flush()
  with pytest.raises(RuntimeError, match="writing metrics failed"):
    broken.close()


def test_expert_load_heatmap_has_its_axes_and_a_colour_scale():
  """`moe/expert_load` as a person reads it: the cells in the diverging map's colours at
  rows / fair share (here 0, 0.5, 1 and 2.5, clipped to 2), a colour bar beside them, the
  figure's width fixed and its height growing with the layers."""
  import matplotlib
  import tensorflow as tf
  load = np.array([[0, 10, 20, 10], [5, 5, 5, 5], [25, 5, 5, 5]])  # fair shares 10, 5, 10
  png = expert_load.render(load, 0, 9)
  image = tf.io.decode_png(png).numpy()[..., :3]
  assert png_size(png) == (image.shape[1], image.shape[0])
  assert image.shape[1] == expert_load.WIDTH_PIXELS
  assert tf.io.decode_png(expert_load.render(np.ones((12, 4)), 0, 0)).shape[0] > image.shape[0]
  cmap = matplotlib.colormaps[expert_load.COLORMAP]
  colours = {tuple(c) for c in image.reshape(-1, 3)}
  for value in (0.0, 0.5, 1.0, 2.0):  # every cell's colour is drawn
    rgb = tuple(int(c) for c in cmap(value / 2, bytes=True)[:3])
    assert rgb in colours, (value, rgb)
  # The colour bar: a column holding most of the map's 256 levels, in order (top: 2x); it is
  # resampled to its height, so its pixels are within a few units of the map's colours.
  lut = np.asarray(cmap(np.arange(256), bytes=True))[:, :3].astype(int)

  def levels(column):
    distance = np.abs(column[:, None, :].astype(int) - lut[None]).sum(-1)
    return [int(i) for i, d in zip(distance.argmin(1), distance.min(1)) if d <= 6]
  bar = max((levels(image[:, x]) for x in range(image.shape[1])), key=lambda l: len(set(l)))
  assert len(set(bar)) > 100 and bar == sorted(bar, reverse=True), len(set(bar))


def test_expert_load_heatmap_puts_layers_down_and_experts_across():
  """Each cell of `moe/expert_load` at its place: a layer's experts left to right, the layers
  top to bottom. Layer 0's eight experts have eight loads (0 to 2x the fair share, eight
  colours), layer 1's are all fair; each colour's pixels (the cell's block, and a sliver of the
  colour bar's) sit at that cell's column and row, read at their median."""
  import matplotlib
  import tensorflow as tf
  load = np.array([np.arange(8) * 2, np.full(8, 5)])  # layer 0 / its fair share 7: 0 .. 2
  image = tf.io.decode_png(expert_load.render(load, 0, 0)).numpy()[..., :3]
  cmap = matplotlib.colormaps[expert_load.COLORMAP]

  def place(value):
    """(median x, median y) of the pixels in `value`'s colour (value in fair shares)."""
    rgb = np.asarray(cmap(value / expert_load.LOAD_RANGE[1], bytes=True)[:3])
    ys, xs = np.nonzero(np.all(image == rgb, axis=-1))
    assert len(xs), value
    return np.median(xs), np.median(ys)

  experts = [place(v) for v in expert_load.relative_load(load)[0]]
  fair = place(1.0)
  xs, ys = zip(*experts)
  assert np.all(np.diff(xs) > 0) and max(ys) - min(ys) <= 1, experts  # one row, left to right
  assert fair[1] > max(ys), (fair, experts)  # layer 1's row below layer 0's


def _summary_values(folder) -> list:
  """Every summary value of the one event file in `folder`, in the order written."""
  from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
  (path,) = glob.glob(f"{folder}/events.out.tfevents.*")
  return [v for e in EventFileLoader(path).Load() for v in e.summary.value]


def test_the_factor_story_leads_the_custom_scalars_layout(tmp_path):
  """The run's event file holds TensorBoard's custom-scalars layout: first the buffer-factor
  chart, whose one tag is written in three runs (in force, required, recommended), so three
  lines in three colours, each named by its run; then the fallback frequency, the fallback
  layers and the dropped rows, each on its own axes; last the required factor of every MoE
  layer (their tags, not the layers' maximum). Each tag's first point carries its description,
  in the run and in each series' run (TensorBoard shows the chart's tag described by them)."""
  from tensorboard.plugins.custom_scalar import layout_pb2
  writer = MoEMetricsWriter(str(tmp_path), asynchronous=False)
  for step in range(3):
    writer.write_scalars(step, {tags.FACTOR_IN_FORCE_TAG: 2.0,
                                tags.REQUIRED_FACTOR_TAG: 1.5 + step,
                                tags.RECOMMENDED_FACTOR_TAG: 3.5, tags.FREQUENCY_TAG: 0.5})
  writer.close()
  values = _summary_values(tmp_path)
  [config] = [v for v in values if v.tag == "custom_scalars__config__"]
  [category] = layout_pb2.Layout.FromString(config.tensor.string_val[0]).category
  assert [list(chart.multiline.tag) for chart in category.chart] == [
      ["^moe/buffer_factor$"], ["^moe/fallback_frequency$"],
      ["^learning/moe_dropless_fallback_layers$"], ["^moe/dropped_rows_fraction$"],
      [r"^moe/required_ragged_buffer_factor/layer_\d+$"]]
  [per_layer] = category.chart[-1].multiline.tag
  run_tags = ["moe/required_ragged_buffer_factor", "moe/required_ragged_buffer_factor/layer_0",
              "moe/required_ragged_buffer_factor/layer_11", "moe/load_max_over_mean/layer_0"]
  assert [t for t in run_tags if re.search(per_layer, t)] == [
      "moe/required_ragged_buffer_factor/layer_0", "moe/required_ragged_buffer_factor/layer_11"]
  described = [v.tag for v in values if v.metadata.summary_description]
  assert sorted(described) == sorted([tags.FACTOR_IN_FORCE_TAG, tags.REQUIRED_FACTOR_TAG,
                                      tags.RECOMMENDED_FACTOR_TAG, tags.FREQUENCY_TAG])
  for name in tags.FACTOR_SERIES:
    noted = [(v.tag, v.metadata.summary_description) for v in _summary_values(tmp_path / name)
             if v.metadata.summary_description]
    assert [tag for tag, _ in noted] == [tags.FACTOR_SERIES_TAG] and all(
        series in noted[0][1] for series in ("in force", "required", "recommended")), (
            name, noted)
  series = {name: read_scalars(str(tmp_path / name))[tags.FACTOR_SERIES_TAG]
            for name in tags.FACTOR_SERIES}
  assert series == {"buffer_factor/in_force": {0: 2.0, 1: 2.0, 2: 2.0},
                    "buffer_factor/required": {0: 1.5, 1: 2.5, 2: 3.5},
                    "buffer_factor/recommended": {0: 3.5, 1: 3.5, 2: 3.5}}


def test_the_run_folder_is_named_and_kept(tmp_path):
  """Events go to a folder named after the workdir (TensorBoard's run "default", not "."); a
  renamed workdir keeps writing to the folder its first start made."""
  workdir = tmp_path / "default"
  assert run_dir(str(workdir)) == str(workdir / "default")
  MoEMetricsWriter(run_dir(str(workdir)), asynchronous=False).close()
  (workdir / "checkpoints").mkdir()
  workdir.rename(tmp_path / "renamed")
  assert run_dir(str(tmp_path / "renamed")) == str(tmp_path / "renamed" / "default")
