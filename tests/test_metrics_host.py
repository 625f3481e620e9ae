"""Host-side aggregation and alert rules, driven by synthetic layer events."""
import json
import threading

import numpy as np
import pytest

from metrics import Aggregator, AlertConfig, AlertManager
from metrics.emit import CAPPED_EVENT, FALLBACK_EVENT, LayerEvent
from moe_hk import MoEStats


def _event(step, layer, shard=0, attempt=0, fallback=0, factor=1.0, would_drop=0, dropped=0,
           tokens=(4, 4, 4, 4)):
  stats = MoEStats(np.int32(fallback), np.float32(factor), np.int32(would_drop),
                   np.int32(dropped), np.asarray(tokens, np.int32), np.float32(0.01),
                   np.float32(0.001), np.int32(0))
  return LayerEvent(FALLBACK_EVENT if fallback else CAPPED_EVENT, step, layer, shard, attempt,
                    stats)


def test_duplicates_collapse_to_one_record_per_layer_and_remember_shards():
  agg = Aggregator()
  for shard in range(8):
    for _ in range(2):  # remat: a second pass
      agg(_event(3, 0, shard, fallback=1, factor=2.5, would_drop=7))
      agg(_event(3, 1, shard, factor=0.75))
  m = agg.finish_step(3)
  assert sorted(m.layers) == [0, 1]
  assert m.layers[0].shards == frozenset(range(8))
  assert m.fallback_layers == 1 and m.required_factor == 2.5
  assert m.layers[0].would_drop_rows == 7 and m.layers[0].routed_rows == 16
  assert not m.replayed


def test_replay_attempt_replaces_the_discarded_one():
  agg = Aggregator()
  agg(_event(4, 0, dropped=5, would_drop=5, factor=3.0))
  agg(_event(4, 0, attempt=1, fallback=1, would_drop=5, factor=3.0))
  agg(_event(4, 0, attempt=0, dropped=5, would_drop=5, factor=3.0))  # a late duplicate
  m = agg.finish_step(4)
  assert m.replayed and m.layers[0].fallback and m.layers[0].dropped_rows == 0
  assert m.dropped_rows_fraction == 0


def test_dropped_fraction_frequency_and_recommended_factor():
  agg = Aggregator(window=4, quantile=0.5)
  history = [(1.0, 0), (3.0, 1), (2.0, 0), (5.0, 1), (1.5, 0)]
  for step, (factor, fell_back) in enumerate(history):
    agg(_event(step, 0, fallback=fell_back, factor=factor, dropped=2 * (1 - fell_back)))
    m = agg.finish_step(step)
  # The window holds the last 4 steps: factors 3, 2, 5, 1.5 and fallbacks 1, 0, 1, 0.
  assert m.fallback_frequency == 0.5
  assert m.recommended_factor == pytest.approx(np.quantile([3.0, 2.0, 5.0, 1.5], 0.5))
  assert m.dropped_rows_fraction == 2 / 16


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


def test_thread_safe_under_concurrent_callbacks():
  agg = Aggregator()
  def send(shard):
    for step in range(50):
      agg(_event(step, shard % 3, shard))
  threads = [threading.Thread(target=send, args=(s,)) for s in range(8)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  for step in range(50):
    m = agg.finish_step(step)
    assert sorted(m.layers) == [0, 1, 2]
    assert m.layers[0].shards == frozenset({0, 3, 6})


class _Steps:
  """Finished steps of a two-layer model whose layer 0 is described by the keywords."""

  def __init__(self):
    self.aggregator = Aggregator(window=10)

  def __call__(self, step, **layer0):
    self.aggregator(_event(step, 0, **layer0))
    self.aggregator(_event(step, 1, factor=0.5))
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
  assert set(first) == {"time", "step", "rule", "layers", "since", "frequency",
                        "required_factor", "recommended_ragged_buffer_factor", "message"}
  assert first["rule"] == "fallback_ran" and first["layers"] == [0] and first["step"] == 0
  later = [a for a in received if a.rule == "fallback_ran"][-1]
  assert later.since == 0 and later.step == 10
  assert later.recommended_ragged_buffer_factor == pytest.approx(2.3)
  assert "ragged_buffer_factor=2.3" in later.message


def test_frequency_rule_fires_above_threshold_only(manager):
  m, received, _, steps = manager
  for step in range(10):  # 2 fallbacks in 10 steps: 20% < 30%
    m.check(steps(step, fallback=int(step in (3, 7)), factor=1.8))
  assert not [a for a in received if a.rule == "frequent_fallback"]
  for step in range(10, 14):  # 4 more: 5 of the last 10
    m.check(steps(step, fallback=1, factor=1.8))
  frequent = [a for a in received if a.rule == "frequent_fallback"]
  assert frequent and frequent[0].frequency > 0.3


def test_drop_and_near_worst_case_rules(manager):
  m, received, _, steps = manager
  rules = {a.rule for a in m.check(steps(0, dropped=4, would_drop=4, factor=3.7))}
  assert rules == {"rows_dropped", "near_worst_case"}
  assert m.check(steps(1, factor=3.5)) == []  # 3.5 < 0.9 * 4
