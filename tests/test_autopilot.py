"""The buffer-factor autopilot's host logic: the candidate factors, lowering, raising,
hysteresis, the program cache's memory and recompile budgets (the end-to-end run is in
test_launch)."""
import math
import threading
from typing import NamedTuple

import numpy as np
import pytest

import moe_hk
from launch.configs import tiny
from metrics import factor_advice
from launch.planning import autopilot, step_model as step_time
from metrics.alerts import AlertManager


def test_candidate_factors_are_multiples_of_the_step_up_to_the_worst_case():
  np.testing.assert_allclose(factor_advice.candidate_factors(0.5, 0.125), [0.125, 0.25, 0.375, 0.5])
  np.testing.assert_allclose(factor_advice.candidate_factors(1.75, 0.5), [0.5, 1.0, 1.5, 1.75])


def _controller(**kw):
  args = dict(factor=3.0, target=0.1, worst_case=4.0, window=20, factor_step=0.25)
  args.update(kw)
  return autopilot.FactorController(args.pop("factor"), **args)


def test_lowers_after_a_full_window_to_the_smallest_candidate_meeting_the_target():
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
  assert c.propose() is None  # memory grows with the factor: 1.0 refused refuses 1.25 too
  c.refused = {1.25}
  assert c.propose().factor == 1.0
  restored = _controller(factor=2.0)
  restored.load_state_dict(c.state_dict())
  assert restored.state_dict() == c.state_dict() and restored.factor == 3.0
  assert restored.propose() == c.propose()


@pytest.mark.parametrize("kw,pattern", [
    (dict(target_fallback_frequency=0.0), "target_fallback_frequency=0.0"),
    (dict(window=2), r"autopilot\.window=2"),
    (dict(objective="speed"), "objective='speed' is invalid: must be one of 'throughput', "
                              "'fallback_frequency'"),
    (dict(max_fallback_frequency=1.5), r"max_fallback_frequency=1\.5 must be in \(0, 1\]"),
    (dict(max_programs=0), r"max_programs=0 must be >= 1"),
    (dict(memory_budget_gib=-1.0), r"memory_budget_gib=-1\.0 must be >= 0"),
])
def test_bad_settings(kw, pattern):
  """`config.autopilot` is checked once, where the config is built (`launch.settings`)."""
  section = tiny.get_config().autopilot
  section.update(enabled=True, **kw)
  layer = moe_hk.MoEConfig(8, 2, 16, 32, ragged_buffer_factor=2.0)
  autopilot.check_settings(tiny.get_config().autopilot, layer)  # the defaults are valid
  with pytest.raises(ValueError, match=pattern):
    autopilot.check_settings(section, layer)


def test_the_autopilot_needs_a_capped_buffer_and_a_fallback():
  section = tiny.get_config().autopilot
  section.enabled = True
  for layer in (moe_hk.MoEConfig(8, 2, 16, 32, ragged_buffer_factor=-1),
                moe_hk.MoEConfig(8, 2, 16, 32, ragged_buffer_factor=2.0,
                                 moe_dropless_fallback="none")):
    with pytest.raises(ValueError, match="needs a capped buffer .* and a fallback"):
      autopilot.check_settings(section, layer)


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


# The throughput objective on a synthetic run whose true times are known: a capped step costs
# 0.2 + 0.05 f s, a fallback chunk 0.01 f s, and a layer's fallback runs ceil(4 / f) chunks.
LAYERS = 3
FLOPS = step_time.StepFlops(fixed=0.2e12, per_factor=0.05e12, moe_layers=LAYERS)


def chunks(factor: float) -> float:
  return float(math.ceil(4 / factor)) if factor >= 1 else math.nan


def true_step(factor: float, required: np.ndarray, chunk_scale: float = 1.0) -> float:
  """Mean seconds per step over `required [steps, layers]` at `factor`."""
  overflowing = (required > factor).sum(axis=1).mean()
  return 0.2 + 0.05 * factor + overflowing * chunks(factor) * 0.01 * chunk_scale * factor


def _throughput(factor, **kw):
  args = dict(target=0.01, worst_case=4.0, window=20, factor_step=0.25, objective="throughput",
              max_frequency=0.5, pricing=autopilot.Pricing(FLOPS, chunks))
  args.update(kw)
  return autopilot.FactorController(factor, **args)


def _feed(controller, required, chunk_scale=1.0, noise=0.0, intervals=6, seed=0, slower=0.0):
  """The window's steps, then `intervals` timed intervals of 5 steps at the factor in force,
  drawn from the window so the chunks per interval vary; `slower` s added to every step."""
  rng = np.random.default_rng(seed)
  f = controller.factor
  for r in required:
    controller.observe(r, fell_back=bool((r > f).any()))
  for i in range(intervals):
    part = required[5 * (i % 4):5 * (i % 4) + 5]
    ran = int((part > f).sum() * chunks(f))
    seconds = 5 * (0.2 + 0.05 * f + slower) + ran * 0.01 * chunk_scale * f
    controller.observe_interval(f, 5, ran, seconds * (1 + noise * rng.standard_normal()))


def _required(seed=0, low=1.0, high=2.8):
  """[20 steps, LAYERS] required factors, the steps that need the most first (so the window's
  last quarter, which the guard watches, needs the least)."""
  required = np.random.default_rng(seed).uniform(low, high, (20, LAYERS))
  return required[np.argsort(-required.max(axis=1))]


def test_throughput_moves_to_the_fastest_factor_within_the_guard():
  required = _required()
  c = _throughput(2.5)  # some layers overflow: the intervals separate a chunk from a step
  _feed(c, required, chunk_scale=5.0)
  prices = c.prices()
  candidates = [f for f in c.candidates if c.predicted_frequency(f) <= 0.5]
  assert sorted(prices) == sorted(map(float, candidates)) and 2.5 in prices
  for f, estimate in prices.items():  # one factor measured: the FLOPs and the chunk fit are exact
    np.testing.assert_allclose(estimate.seconds, true_step(f, required, 5.0), rtol=1e-9)
  best = min(candidates, key=lambda f: true_step(f, required, 5.0))
  decision = c.propose(steps_left=10_000, compile_seconds=30.0)
  assert decision.reason == "faster" and decision.factor == best != 2.5
  old, new = (decision.evidence["predicted_step_seconds"][k] for k in ("old", "new"))
  assert new < 0.97 * old
  assert decision.evidence["payback_steps"] == pytest.approx(30.0 / (old - new))
  # The compile would not pay for itself in the steps left: stay; unless the program exists.
  assert c.propose(steps_left=int(30.0 / (old - new)), compile_seconds=30.0) is None
  again = c.propose(steps_left=int(30.0 / (old - new)), compile_seconds=30.0, compiled={best})
  assert again.factor == best and again.evidence["payback_steps"] == 0.0
  # One rule (metrics.factor_advice) names the factor; a compiled program only makes taking
  # it free: a slower factor whose program exists is not taken instead.
  second = sorted(prices, key=lambda f: prices[f].seconds)[1]
  assert c.propose(10_000, compile_seconds=30.0, compiled={second}).factor == best
  assert c.advice().factor == best and c.advice().objective == "throughput"


def test_throughput_does_not_act_on_noise_small_gains_or_before_a_window():
  """Each case beside its control, the same run without what holds the move back: at 2.5 a
  faster factor exists (the test above), and the controller takes it unless the window is
  not full, the timings' noise is larger than the gain, or the gain is below `min_gain`."""
  required = _required()
  def decision(steps=required, noise=0.0, **kw):
    c = _throughput(2.5, **kw)
    _feed(c, steps, chunk_scale=5.0, noise=noise, intervals=3)
    return c.propose(steps_left=10_000, compile_seconds=30.0)
  control = decision()
  assert control is not None and control.reason == "faster", control
  gain = 1 - (control.evidence["predicted_step_seconds"]["new"] /
              control.evidence["predicted_step_seconds"]["old"])
  half = required[::2]                      # every other step: the same spread of needs
  assert decision(half) is None             # half a window
  assert decision(np.repeat(half, 2, axis=0)).reason == "faster"  # its full window
  assert decision(noise=0.5) is None        # the prediction's error is larger than the gain
  assert decision(min_gain=gain + 0.01) is None   # a gain below min_gain is not worth a program
  assert decision(min_gain=gain - 0.01) == control


def test_throughput_guard_raises_at_once_when_fallbacks_exceed_the_bound():
  c = _throughput(1.0, window=20)
  c.switched(1.0)
  required = np.full((5, LAYERS), 1.2)
  required[:, 0] = [2.1, 2.2, 1.9, 2.0, 1.8]
  for r in required:  # 5 of the last 5 steps fell back: > 0.5
    c.observe(r, fell_back=True)
  decision = c.propose()
  assert decision.reason == "raise" and decision.factor == 2.0
  assert c.predicted_frequency(1.75) == 1.0 and c.predicted_frequency(2.0) == 0.4  # 2.1, 2.2


class Stats(NamedTuple):  # the fields of MoEStats the autopilot reads
  required_factor: np.ndarray  # [layers]
  fallback: np.ndarray         # [layers]


def test_throughput_under_a_budget_never_runs_a_program_past_it_and_takes_the_fastest_that_fits():
  """Expensive fallbacks make a large factor the fastest; a budget of 275 bytes (factors up to
  2.75) refuses it (compiled, never run), and the autopilot moves to the fastest that fits."""
  required = _required(seed=1)
  memory = lambda f: int(f * 100)
  alerts = AlertManager(worst_case_factor=4.0)
  changes = []
  def on_change(step, old, new, decision):
    changes.append(alerts.factor_changed(step, old, new, decision.reason, decision.evidence))
  cache = autopilot.ProgramCache(lambda f: autopilot.Program(f, f"step {f}", memory(f)),
                                 budget_bytes=275, max_programs=8)
  c = _throughput(2.5)
  pilot = autopilot.Autopilot(c, cache, wait=True, on_change=on_change)
  try:
    _feed(c, required, chunk_scale=40.0)
    prices = {f: e.seconds for f, e in c.prices().items()}
    fastest = min(prices, key=prices.get)
    fits = min((f for f in prices if memory(f) <= 275), key=prices.get)
    assert memory(fastest) > 275 and fits != 2.5
    # A step alone prices nothing (only the guard and the frequency rules run per step).
    pilot.observe(Stats(required[0], required[0] > c.factor))
    assert pilot.switch(20) is None and not c.refused
    # Each interval, timed by the true model (as `_feed`'s), prices the candidates again.
    ran = int((required[:5] > 2.5).sum() * chunks(2.5))
    interval = lambda: pilot.observe_interval(
        2.5, 5, ran, 5 * (0.2 + 0.05 * 2.5) + ran * 0.01 * 40.0 * 2.5, steps_left=1000)
    interval()                               # proposes the fastest: compiled, over budget
    assert pilot.switch(21) is None and fastest in c.refused and c.factor == 2.5
    interval()                               # the fastest that fits
    program = pilot.switch(22)
    assert program.factor == fits and program.memory_bytes <= 275
    assert [(a.details["old_factor"], a.details["new_factor"]) for a in changes] == [(2.5, fits)]
    assert c.factor == fits
    # The alert says why: the predicted seconds per step at both factors.
    [alert] = changes
    old, new = (alert.details["evidence"]["predicted_step_seconds"][k] for k in ("old", "new"))
    assert (f"ragged_buffer_factor 2.5 -> {fits:g} (faster); predicted {old:.4g} s/step at 2.5, "
            f"{new:.4g} at {fits:g}") in alert.message
    assert "(max 50.0%)" in alert.message
  finally:
    cache.close()


def _pilot(controller, compiles: list) -> autopilot.Autopilot:
  """An autopilot over `controller`, its factor's program compiled, whose compiles cost 30 s
  (a move waits for its compile) and are recorded in `compiles`."""
  def compile_fn(factor):
    compiles.append(factor)
    return autopilot.Program(factor, f"step {factor}", None)
  cache = autopilot.ProgramCache(compile_fn, budget_bytes=None, max_programs=8)
  cache.add(autopilot.Program(controller.factor, f"step {controller.factor}", None))
  pilot = autopilot.Autopilot(controller, cache, wait=True, on_change=lambda *a: None)
  pilot.compile_seconds = 30.0
  return pilot


def test_a_move_that_measured_slower_is_undone_without_a_compile():
  """The one-factor prior (the FLOPs, a lower bound for a smaller buffer) promises a smaller
  factor is faster: the rule names none and the autopilot tries it; measured there, every step
  is 0.2 s slower. Once the new factor's window is in, the model (now a line through both
  factors) prices the old factor fastest, and its program exists: the autopilot moves back
  with no compile, even with one step left."""
  required = _required(high=2.0)  # factors from 2.0 up fall back on at most half the steps
  c = _throughput(2.5, worst_case=2.5)
  compiles = []
  pilot = _pilot(c, compiles)
  try:
    _feed(c, required, chunk_scale=0.01, noise=0.01)
    trial = c.propose(steps_left=10_000, compile_seconds=30.0)
    assert trial.reason == "trial" and c.advice().factor is None
    assert c.advice().trial == trial.factor < 2.5
    alert = AlertManager(worst_case_factor=2.5).factor_changed(20, 2.5, trial.factor,
                                                               trial.reason, trial.evidence)
    new = trial.evidence["predicted_step_seconds"]["new"]
    assert "(trial); predicted " in alert.message
    assert f"{new:.4g} at {trial.factor:g} at best (a lower bound" in alert.message
    pilot.observe_interval(2.5, 5, 0, 5 * (0.2 + 0.05 * 2.5), steps_left=10_000)
    moved = pilot.switch(20)
    assert moved is not None and moved.factor < 2.5 and compiles == [moved.factor]
    _feed(c, required, chunk_scale=0.01, noise=0.01, seed=1, slower=0.2)
    pilot.observe_interval(moved.factor, 5, 0, 5 * (0.2 + 0.05 * moved.factor + 0.2),
                           steps_left=1)
    assert c.propose(steps_left=1, compiled={2.5}).reason == "faster"
    back = pilot.switch(40)
    assert back is not None and back.factor == 2.5 == c.factor
    assert compiles == [moved.factor]  # no second compile
  finally:
    pilot.cache.close()


def test_the_likely_move_compiles_while_the_window_fills_and_then_costs_no_compile():
  """Half a window in, the timed intervals already price a faster factor: its program
  compiles ahead (no move yet: the window is not full). Once it is, the autopilot moves to
  that factor, charged no compile, and compiles nothing more."""
  required = _required(high=2.0)  # the window's first half needs the most
  c = _throughput(3.0)
  compiles = []
  pilot = _pilot(c, compiles)
  timed = lambda: pilot.observe_interval(3.0, 5, 0, 5 * (0.2 + 0.05 * 3.0), steps_left=1000)
  try:
    _feed(c, required[:10], chunk_scale=0.01)
    timed()
    pilot.cache.wait(c.prospect(1000, 30.0))
    [ahead] = compiles
    assert ahead < 3.0 and pilot.switch(10) is None and c.factor == 3.0
    timed()  # still half a window: nothing more compiles
    assert compiles == [ahead]
    for r in required[10:]:
      pilot.observe(Stats(r, r > 3.0))
    timed()
    moved = pilot.switch(20)
    assert moved is not None and moved.factor == ahead == c.factor
    assert compiles == [ahead]
  finally:
    pilot.cache.close()
