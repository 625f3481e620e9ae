"""The buffer-factor autopilot's host logic: the ladder, lowering, raising, hysteresis, the
program cache's memory and recompile budgets (the end-to-end run is in test_launch)."""
import threading

import numpy as np
import pytest

from launch import autopilot


def test_ladder_is_multiples_of_the_rung_up_to_the_worst_case():
  np.testing.assert_allclose(autopilot.ladder(0.125, 0.5), [0.125, 0.25, 0.375, 0.5])
  np.testing.assert_allclose(autopilot.ladder(0.5, 1.75), [0.5, 1.0, 1.5, 1.75])


def _controller(**kw):
  args = dict(factor=3.0, target=0.1, worst_case=4.0, window=20, rung=0.25)
  args.update(kw)
  return autopilot.FactorController(args.pop("factor"), **args)


def test_lowers_after_a_full_window_to_the_smallest_rung_meeting_the_target():
  c = _controller()
  required = [1.1] * 18 + [1.6, 1.9]  # 2 of 20 steps (10%) need more than 1.5
  for i, r in enumerate(required):
    assert c.propose() is None, i  # no decision before a full window
    c.observe(r, fell_back=False)
  decision = c.propose()
  # 1.25 and 1.5 predict 10% (at the target): the smallest wins; 1.0 predicts 100%.
  assert decision.factor == 1.25 and decision.reason == "lower"
  assert decision.evidence["predicted_frequency"] == pytest.approx(0.1)
  assert c.predicted_frequency(1.0) == 1.0 and c.predicted_frequency(1.9) == 0.0
  c.switched(decision.factor)
  assert c.propose() is None  # another full window before lowering again


def test_raises_at_once_on_a_burst_of_fallbacks_and_not_on_one():
  c = _controller(factor=1.25)
  c.switched(1.25)
  for _ in range(15):
    c.observe(1.1, fell_back=False)
  c.observe(1.4, fell_back=True)          # 1 of the last 5 steps: 20% <= 2 x 10% target
  assert c.propose() is None
  c.observe(1.45, fell_back=True)         # 2 of 5: 40% > 20%
  decision = c.propose()
  assert decision.reason == "raise" and decision.factor == 1.5
  assert decision.evidence["observed_recent_frequency"] == pytest.approx(0.4)


def test_refused_factors_are_skipped_and_state_round_trips():
  c = _controller()
  for _ in range(20):
    c.observe(0.9, fell_back=False)
  c.refused.add(1.0)
  assert c.propose().factor == 1.25
  restored = _controller(factor=2.0)
  restored.load_state_dict(c.state_dict())
  assert restored.state_dict() == c.state_dict() and restored.factor == 3.0
  assert restored.propose() == c.propose()


@pytest.mark.parametrize("kw,pattern", [(dict(target=0.0), "target_fallback_frequency=0.0"),
                                        (dict(window=2), r"autopilot\.window=2")])
def test_bad_settings(kw, pattern):
  with pytest.raises(ValueError, match=pattern):
    _controller(**kw)


def test_program_cache_compiles_in_the_background_within_its_budgets():
  release, threads = threading.Event(), []
  def compile_fn(factor):
    threads.append(threading.current_thread().name)
    release.wait(10)
    return autopilot.Program(factor, step=None, memory_bytes=int(factor * 100))
  cache = autopilot.ProgramCache(compile_fn, budget_bytes=250, max_programs=2)
  try:
    assert cache.request(2.0) and cache.ready(2.0) is None  # compiling, training goes on
    release.set()
    assert cache.request(3.0)
    assert not cache.request(1.0)                           # the recompile budget is spent
    cache.request(2.0)                                      # known: not compiled again
    for factor in (2.0, 3.0):
      while cache.ready(factor) is None:
        threading.Event().wait(0.01)
    assert cache.fits(cache.ready(2.0)) and not cache.fits(cache.ready(3.0))  # 300 > 250
    assert threads and all(t.startswith("moe-autopilot") for t in threads)
    assert cache.compiled == 2
  finally:
    cache.close()
