"""The buffer-factor autopilot's host logic: it follows the factor rule on the run's evidence
after each full window, the guard raises at once, moves for speed pay back their compile, the
program cache's memory and recompile budgets (the end-to-end run is in test_launch)."""
import threading

import pytest

import moe_hk
from launch.configs import tiny
from launch.planning import autopilot
from launch.run import trainer_alerts
from metrics.evidence import Evidence
from metrics.factor_rule import Rule

WINDOW = 20


def _controller(factor: float = 3.0, **rule) -> autopilot.FactorController:
  """A controller over fresh evidence: worst case 4, a window of 20, the rule named from 10
  steps on."""
  evidence = Evidence(worst_case=4.0, factor=factor, window=WINDOW,
                      rule=Rule(min_steps=10, **rule))
  return autopilot.FactorController(evidence, window=WINDOW)


def _steps(c: autopilot.FactorController, required, fell_back=None) -> None:
  """Finished steps (one layer) reaching the evidence, as the trainer hands them over."""
  for i, r in enumerate(required):
    c.evidence.add_step([r], bool(r > c.factor) if fell_back is None else fell_back[i])
    c.since_change += 1


def test_follows_the_rules_frequency_pick_after_a_full_window():
  """Started at 3 (timed), the window's steps need at most 1.9 (1 of 20 above 1.5): the rule
  names the smallest factor that would have fallen back on at most 5% of them, never timed,
  from its 10th step on; the controller moves there once the window is full, not before, and
  then keeps it."""
  c = _controller(target=0.05)
  c.evidence.add_interval(3.0, 5, 1.5)  # the factor in force is timed: only the window waits
  required = [1.1] * 19 + [1.9]
  for r in required:
    assert c.propose() is None, c.since_change  # a window must pass first
    _steps(c, [r])
  assert c.evidence.advice.factor == 1.125
  decision = c.propose()
  assert decision.factor == 1.125 and decision.reason == "frequency"
  assert decision.evidence.predicted_frequency == pytest.approx(0.05)
  assert "the smallest factor that would have fallen back on at most 5%" in \
      decision.evidence.advice and "never timed" in decision.evidence.advice
  c.switched(decision.factor)
  assert c.factor == 1.125 and c.evidence.advice.keep
  _steps(c, required)
  assert c.propose() is None  # the rule now says keep


def test_the_factor_in_force_is_timed_before_the_rule_moves_it():
  """A full window names 1.125, but the factor in force has no timed interval yet: no move
  until it has one."""
  c = _controller(target=0.05)
  _steps(c, [1.1] * 19 + [1.9])
  assert c.evidence.advice.factor == 1.125 and c.propose() is None
  c.evidence.add_interval(3.0, 5, 1.5)
  _steps(c, [1.1])  # the rule is evaluated once per finished step
  assert c.propose().factor == 1.125


def test_raises_at_once_on_a_burst_of_fallbacks_and_not_on_one():
  c = _controller(factor=1.25, max_frequency=0.3)
  _steps(c, [1.1] * 16, fell_back=[False] * 16)
  _steps(c, [1.4], fell_back=[True])   # 1 of the last 5 steps: 20% <= 30%
  assert c.propose() is None
  _steps(c, [1.45, 1.5], fell_back=[True, True])  # 3 of 5: 60% > 30%
  decision = c.propose()
  # The smallest factor that would have fallen back on at most 30% of the window (19 steps).
  assert decision.reason == "raise" and decision.factor == 1.375
  assert decision.evidence.observed_recent_frequency == pytest.approx(0.6)
  assert "the guard raised it" in decision.evidence.advice


def test_refused_factors_are_skipped_and_the_state_round_trips():
  c = _controller()
  c.evidence.add_interval(3.0, 5, 1.5)
  _steps(c, [0.8] * WINDOW)
  c.evidence.refuse(1.0)
  assert c.propose().factor == 0.875  # the smallest that covers, below the refused 1.0
  c.evidence.refuse(0.875)
  assert c.propose() is None  # memory grows with the factor: nothing from 0.875 up fits
  pilot = autopilot.Autopilot(c, autopilot.ProgramCache(lambda f: None, budget_bytes=None,
                                                        max_programs=1), on_change=print)
  restored = _controller(factor=2.0)
  restored.evidence.load_state_dict(c.evidence.state_dict())
  again = autopilot.Autopilot(restored, pilot.cache, on_change=print)
  again.load_state_dict(pilot.state_dict())
  assert restored.evidence.state_dict() == c.evidence.state_dict() and restored.factor == 3.0
  assert restored.since_change == c.since_change and restored.propose() == c.propose()
  pilot.cache.close()


def _priced(c: autopilot.FactorController, seconds: dict[float, float], spread: float = 0.001,
            intervals: int = 4) -> None:
  """Timed intervals of 5 steps at each factor, `spread` apart (their standard error)."""
  for factor, per_step in seconds.items():
    for i in range(intervals):
      c.evidence.add_interval(factor, 5, 5 * (per_step + spread * (i - 1.5)))


def test_moves_for_speed_only_between_timed_factors_beyond_the_noise():
  """Steps need 1.1, one in five 2.9: the frequency rule says 3.0 (in force, timed). 2.0
  falls back on 20% and was timed 10% faster: the rule names it. 1.25 falls back as often
  and would be faster still, but was never timed: it is never taken for its speed. A 2%
  gain is noise (below min_gain 3%): the control keeps 3."""
  required = ([1.1] * 4 + [2.9]) * 4
  c = _controller(factor=3.0)
  _steps(c, required)
  _priced(c, {3.0: 0.30, 2.0: 0.27})
  c.evidence.add_step([1.1], False)
  decision = c.propose(steps_left=1000)
  assert decision.factor == 2.0 and decision.reason == "faster"
  assert c.evidence.advice.basis == "measured"
  assert "faster beyond the noise than 3" in decision.evidence.advice
  # The same window, 2% apart: within the noise.
  noise = _controller(factor=3.0)
  _steps(noise, required)
  _priced(noise, {3.0: 0.30, 2.0: 0.294})
  noise.evidence.add_step([1.1], False)
  assert noise.propose(steps_left=1000) is None and noise.evidence.advice.keep


def test_a_move_for_speed_must_pay_back_its_compile():
  """A 0.03 s gain a step pays back a 30 s compile in 1000 steps: with 500 steps left the
  move waits; with the program compiled already it costs nothing and goes ahead."""
  c = _controller(factor=3.0)
  _steps(c, ([1.1] * 4 + [2.9]) * 4)
  _priced(c, {3.0: 0.30, 2.0: 0.27})
  c.evidence.add_step([1.1], False)
  assert c.propose(steps_left=500, compile_seconds=30.0) is None
  assert c.propose(steps_left=2000, compile_seconds=30.0).factor == 2.0
  assert c.propose(steps_left=500, compile_seconds=30.0, compiled={2.0}).factor == 2.0


def test_the_likely_move_compiles_while_the_window_fills_and_then_costs_no_compile():
  """Half a window in (and past the rule's minimum), the rule already names 1.125: its program
  compiles ahead, with no move before the window is full; then the move takes that program,
  and nothing more compiles."""
  c = _controller(factor=3.0)
  c.evidence.add_interval(3.0, 5, 1.5)  # the factor in force, timed
  compiles = []
  def compile_fn(factor):
    compiles.append(factor)
    return autopilot.Program(factor, f"step {factor}", None)
  cache = autopilot.ProgramCache(compile_fn, budget_bytes=None, max_programs=8)
  cache.add(autopilot.Program(3.0, "step 3", None))
  changes = []
  pilot = autopilot.Autopilot(c, cache, wait=True,
                              on_change=lambda *args: changes.append(args))
  try:
    for _ in range(WINDOW // 2):
      c.evidence.add_step([1.1], False)
      pilot.step_finished(steps_left=1000)
    cache.wait(1.125)
    assert compiles == [1.125] and pilot.switch(10) is None and c.factor == 3.0
    for _ in range(WINDOW // 2):
      c.evidence.add_step([1.1], False)
      pilot.step_finished(steps_left=1000)
    moved = pilot.switch(20)
    assert moved.factor == 1.125 == c.factor and compiles == [1.125]
    [(step, old, new, decision)] = changes
    alert = trainer_alerts.factor_changed(step, old, new, decision)
    assert alert.message.startswith("MoE autopilot [buffer_factor_changed] at step 20: "
                                    "ragged_buffer_factor 3 -> 1.125 (frequency): use "
                                    "ragged_buffer_factor=1.125: the smallest factor")
  finally:
    cache.close()


def test_compiling_ahead_never_spends_the_last_program_of_the_budget():
  """With one program allowed, the rule's answer half a window in (1.5) is not compiled
  ahead: the answer moves (to 1.625) by the time the window is full, and the decision gets
  the program. Compiled ahead, 1.5 would have spent the budget and the run would never move."""
  c = _controller(factor=3.0)
  c.evidence.add_interval(3.0, 5, 1.5)
  compiles = []
  def compile_fn(factor):
    compiles.append(factor)
    return autopilot.Program(factor, f"step {factor}", None)
  cache = autopilot.ProgramCache(compile_fn, budget_bytes=None, max_programs=1)
  cache.add(autopilot.Program(3.0, "step 3", None))
  pilot = autopilot.Autopilot(c, cache, wait=True, on_change=lambda *args: None)
  try:
    for _ in range(WINDOW // 2):
      c.evidence.add_step([1.4], False)
      pilot.step_finished(steps_left=1000)
    assert c.evidence.advice.factor == 1.5 and compiles == []
    for _ in range(WINDOW // 2):
      c.evidence.add_step([1.6], False)
      pilot.step_finished(steps_left=1000)
    assert pilot.switch(WINDOW).factor == 1.625 == c.factor and compiles == [1.625]
  finally:
    cache.close()


def test_a_decision_is_revised_when_the_rule_moves_while_its_program_compiles():
  """The window full, the rule names 1.125 and its program starts compiling (slowly, in the
  background). An answer that moves the same way (1.25) keeps it; before it is ready the
  traffic grows so that the rule keeps 3.0: the decision is dropped, and the finished program
  is never switched to."""
  c = _controller(factor=3.0)
  c.evidence.add_interval(3.0, 5, 1.5)
  release = threading.Event()
  def compile_fn(factor):
    release.wait(10)
    return autopilot.Program(factor, f"step {factor}", None)
  cache = autopilot.ProgramCache(compile_fn, budget_bytes=None, max_programs=1)
  cache.add(autopilot.Program(3.0, "step 3", None))
  pilot = autopilot.Autopilot(c, cache, on_change=lambda *args: None)
  try:
    for _ in range(WINDOW):
      c.evidence.add_step([1.1], False)
      pilot.step_finished(steps_left=1000)
    assert pilot.switch(WINDOW) is None and cache.busy()  # 1.125 compiling
    c.evidence.add_step([1.2], False)
    pilot.step_finished(steps_left=1000)
    assert c.evidence.advice.factor == 1.25 and pilot._decision.factor == 1.125
    for _ in range(WINDOW):
      c.evidence.add_step([2.9], False)
      pilot.step_finished(steps_left=1000)
    assert c.evidence.advice.keep, c.evidence.advice.reason
    release.set()
    cache.wait(1.125)
    assert pilot.switch(2 * WINDOW) is None and c.factor == 3.0
  finally:
    release.set()
    cache.close()


def test_a_program_over_the_budget_is_refused_for_good():
  """The rule names 1.125; its program needs 112 bytes against a budget of 100: compiled,
  never run, refused (with every larger factor), and the run stays at its factor."""
  c = _controller(factor=0.875)
  cache = autopilot.ProgramCache(lambda f: autopilot.Program(f, None, int(f * 100)),
                                 budget_bytes=100, max_programs=8)
  pilot = autopilot.Autopilot(c, cache, wait=True, on_change=lambda *a: None)
  try:
    for _ in range(WINDOW):
      c.evidence.add_step([1.1], True)
      pilot.step_finished(steps_left=1000)
    assert pilot.switch(20) is None and c.evidence.refused == {1.125}
    assert c.factor == 0.875 and not c.evidence.fits(2.0)
  finally:
    cache.close()


@pytest.mark.parametrize("kw,pattern", [
    (dict(target_fallback_frequency=0.0), "target_fallback_frequency=0.0"),
    (dict(window=2), r"autopilot\.window=2"),
    (dict(objective="speed"), "objective='speed' is invalid: must be one of 'throughput', "
                              "'fallback_frequency'"),
    (dict(max_fallback_frequency=1.5), r"max_fallback_frequency=1\.5 must be in \(0, 1\]"),
    (dict(max_programs=0), r"max_programs=0 must be >= 1"),
    (dict(memory_budget_gib=-1.0), r"memory_budget_gib=-1\.0 must be >= 0"),
    (dict(min_steps=0), r"min_steps=0 must be in \[1, config.autopilot.window=100\]"),
    (dict(min_steps=101), r"min_steps=101 must be in \[1, config.autopilot.window=100\]"),
])
def test_bad_settings(kw, pattern):
  """`config.autopilot` is checked once, where the config is built (`launch.setup.settings`)."""
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
  with pytest.raises(ValueError, match="needs config.moe_metrics=True"):
    autopilot.check_settings(section, moe_hk.MoEConfig(8, 2, 16, 32, ragged_buffer_factor=2.0),
                             moe_metrics=False)


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
