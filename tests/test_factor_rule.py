"""The factor rule (`metrics.factor_rule`) and its evidence (`metrics.evidence`): the frequency
rule, the measured-speed exception, the minimum window, "keep", prices only where measured."""
import math
import subprocess
import sys

import numpy as np
import pytest

from metrics import factor_rule
from metrics.evidence import Evidence
from metrics.factor_rule import Price, Rule
from tests.helpers import ROOT

# 20 steps, 2 layers: layer 0 needs 1.1 on every step, layer 1 needs 1.9 on one step in five.
REQUIRED = np.array([[1.1, 1.9 if i % 5 == 0 else 1.0] for i in range(20)])


def advise(**kw) -> factor_rule.Advice:
  return factor_rule.advise(REQUIRED, worst_case=4.0, **kw)


def test_the_frequency_rule_names_the_smallest_factor_at_most_the_target():
  a = advise(rule=Rule(target=0.01))
  # At 1.875 the steps needing 1.9 fall back (20%); 2.0 covers every step.
  assert a.factor == 2.0 and a.basis == "frequency" and not a.keep
  assert a.reason == ("use ragged_buffer_factor=2: the smallest factor that would have fallen "
                      "back on at most 1% of the last 20 steps (0); it was never timed.")
  assert advise(rule=Rule(target=0.25)).factor == 1.125  # 4 of 20 steps allowed
  rows = {r.factor: r for r in a.rows}
  assert rows[1.875].fallback_frequency == 0.2 and rows[1.0].fallback_frequency == 1.0
  assert rows[1.0].overflowing_layers == pytest.approx(1.2)
  assert all(r.price is None for r in a.rows)


def test_below_the_minimum_window_nothing_is_named():
  a = factor_rule.advise(REQUIRED[:12], worst_case=4.0, rule=Rule(min_steps=20),
                         prices={2.0: Price(0.3, 0.001, "measured")})
  assert a.factor is None and not a.enough
  assert a.reason == "12 of 20 steps of evidence: too few to name a factor yet."


def test_the_factor_in_force_reads_keep():
  a = advise(current=2.0)
  assert a.keep and a.reason.startswith("keep ragged_buffer_factor=2: ")


def test_a_measured_factor_faster_beyond_the_noise_replaces_the_frequency_pick():
  """2.0 (the frequency pick) and 1.5 (falls back on 20%) measured, 1.5 10% faster: named. A
  1% gain, or one whose error is unknown, is noise; 1.5 over max_frequency is never named."""
  prices = {2.0: Price(0.30, 0.002, "measured"), 1.5: Price(0.27, 0.002, "measured")}
  a = advise(prices=prices, current=2.0)
  assert a.factor == 1.5 and a.basis == "measured"
  assert a.reason == ("use ragged_buffer_factor=1.5: 0.27 ± 0.002 s/step measured, falling "
                      "back on 20% of the last 20 steps (at most 50%); faster beyond the noise "
                      "than 2 (0.3 ± 0.002 s/step measured).")
  close = {**prices, 1.5: Price(0.297, 0.002, "measured")}
  assert advise(prices=close, current=2.0).factor == 2.0
  unknown = {2.0: Price(0.30, math.inf, "measured"), 1.5: Price(0.27, 0.002, "measured")}
  assert advise(prices=unknown).factor == 2.0
  assert advise(prices=prices, rule=Rule(max_frequency=0.1)).factor == 2.0


def test_no_price_is_extrapolated_to_a_factor_never_timed():
  """Only the measured factors carry a price. The frequency pick (2) never timed: a measured
  smaller factor that falls back on at most half the steps (1.5) is named, the reason saying
  2 was never timed; measured factors above the pick (3) fall back as rarely with a bigger
  buffer and never replace it."""
  prices = {3.0: Price(0.25, 0.002, "measured"), 1.5: Price(0.27, 0.002, "measured")}
  a = advise(prices=prices)
  assert {r.factor for r in a.rows if r.price is not None} == {3.0, 1.5}
  assert a.factor == 1.5 and a.basis == "measured"
  assert a.reason.endswith("; 2, the smallest factor that falls back on at most 1%, was never "
                           "timed.")
  above = advise(prices={3.0: Price(0.25, 0.002, "measured")})
  assert above.factor == 2.0 and above.basis == "frequency"
  assert above.reason.endswith("it was never timed.")


def test_the_factor_in_force_is_kept_within_the_noise():
  """The frequency pick (2) never timed; the factor in force (1.75) and 1.5 measured below
  it, 1.5 1% faster: noise, so 1.75 is kept; 10% faster, 1.5 is named."""
  near = {1.75: Price(0.300, 0.002, "measured"), 1.5: Price(0.297, 0.002, "measured")}
  kept = advise(prices=near, current=1.75)
  assert kept.factor == 1.75 and kept.keep
  assert "no measured factor is faster beyond the noise; 2, the smallest" in kept.reason
  far = {**near, 1.5: Price(0.27, 0.002, "measured")}
  assert advise(prices=far, current=1.75).factor == 1.5


def test_nothing_named_when_no_factor_that_fits_covers_the_target():
  a = advise(fits=lambda f: f < 1.5)
  assert a.factor is None
  assert a.reason == ("no factor that fits the memory budget falls back on at most 1% of the "
                      "last 20 steps.")


def test_measured_prices_are_each_factors_own_intervals():
  prices = factor_rule.measured_prices([2, 2, 2, 1.5], [10, 10, 20, 10], [3.0, 3.2, 6.2, 2.5])
  assert prices[2.0].seconds == pytest.approx(12.4 / 40)
  rates = np.array([0.30, 0.32, 0.31])
  assert prices[2.0].se == pytest.approx(rates.std(ddof=1) / math.sqrt(3))
  assert prices[1.5] == Price(0.25, math.inf, "measured")
  assert "error unknown" in str(prices[1.5])


def test_evidence_evaluates_the_rule_once_per_step_and_round_trips():
  ev = Evidence(worst_case=4.0, factor=2.0, window=10, rule=Rule(min_steps=3))
  for r in REQUIRED[:12]:
    ev.add_step(r, bool(r.max() > 2.0))
  ev.add_interval(2.0, 5, 1.5)
  ev.add_interval(2.0, 5, 1.6)
  assert ev.steps == 10 and ev.advice.factor == 2.0 and ev.advice.rows[0].price is None
  ev.add_step(REQUIRED[12], False)  # the intervals price 2.0 from the next step on
  assert ev.prices()[2.0].seconds == pytest.approx(0.31)
  assert next(r for r in ev.advice.rows if r.factor == 2.0).price.basis == "measured"
  restored = Evidence(worst_case=4.0, factor=3.0, window=10, rule=Rule(min_steps=3))
  restored.load_state_dict(ev.state_dict())
  assert restored.state_dict() == ev.state_dict() and restored.advice == ev.advice
  # A checkpoint written before the evidence had its own home: the aggregator's windows.
  legacy = Evidence(worst_case=4.0, factor=2.0, window=10, rule=Rule(min_steps=3))
  legacy.load_state_dict({"finished_through": 12, "fell_back": [False] * 10,
                          "required": [list(r) for r in REQUIRED[3:13]]})
  assert legacy.required().tolist() == ev.required().tolist() and legacy.factor == 2.0


def test_the_rule_and_the_planner_import_no_jax():
  """The host-only layer (also an import-linter contract, run by `make test`): of moe_hk, only
  the jax-free buffer sizing."""
  code = ("import sys, launch.planning.replay, launch.planning.autopilot, "
          "launch.planning.capacity_report, metrics.evidence; "
          "print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'haiku', 'moe_hk')))")
  done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                        check=True)
  assert done.stdout.strip() == "['moe_hk', 'moe_hk.buffer_size']"
