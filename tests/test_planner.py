"""`launch.capacity` priced: the run's measured intervals and `--time_config`'s timed steps, the
pick a row of the table marked with its basis, and one answer with the run's own rule."""
import json

import numpy as np
import pytest

from launch import capacity
from launch.planning import replay
from metrics import factor_rule
from metrics.evidence import Evidence
from metrics.traffic import TrafficRecorder, read_traffic
from tests.test_capacity import META, run_main, skewed_counts

# Seconds per step the synthetic run measured at the two factors it ran (1.5 and 2.2).
SECONDS = {1.5: 0.20, 2.2: 0.25}


@pytest.fixture(scope="module")
def timed_run(tmp_path_factory):
  """300 steps, 100 at 1.5 then 200 at 2.2, in 10-step intervals timed at SECONDS (+-1%)."""
  workdir = tmp_path_factory.mktemp("timed")
  recorder = TrafficRecorder(str(workdir), **META)
  counts = skewed_counts(3, 300)
  rng = np.random.default_rng(0)
  for first in range(0, 300, 10):
    factor = 1.5 if first < 100 else 2.2
    chunks = np.zeros(counts.shape[1:2], np.int32)[None].repeat(10, 0)
    recorder.append(range(first, first + 10), counts[first:first + 10], [factor] * 10, chunks,
                    seconds=10 * SECONDS[factor] * rng.uniform(0.99, 1.01))
  return workdir


def answer(capsys, *args) -> dict:
  """The planner's JSON answer; what it printed on stderr under the key 'stderr'."""
  run_main(*args, "--format=json")
  out = capsys.readouterr()
  return {**json.loads(out.out), "stderr": out.err}


def test_measured_rows_carry_their_basis_and_the_pick_is_a_row(timed_run, capsys):
  """Only the factors the run ran are priced ('measured'); the pick is a row of the table, and
  no admissible measured row is cheaper than it beyond the rule's margin."""
  out = answer(capsys, f"--workdir={timed_run}", "--window=0")
  rows = {r["factor"]: r for r in out["rows"]}
  assert {f for f, r in rows.items() if r["basis"] == "measured"} == set(SECONDS)
  assert all(r["step_seconds"] is None for f, r in rows.items() if f not in SECONDS)
  for f, seconds in SECONDS.items():
    assert rows[f]["step_seconds"] == pytest.approx(seconds, rel=0.01)
  [pick] = [r for r in out["rows"] if r["pick"]]
  assert pick["factor"] == out["pick"]
  rule = factor_rule.Rule()
  if pick["step_seconds"] is not None:
    for r in rows.values():
      if r["basis"] == "measured" and r["fallback_frequency"] <= rule.max_frequency:
        assert r["step_seconds"] >= pick["step_seconds"] * (1 - rule.min_gain) - 1e-12
  # The rule the run itself evaluates on the same window gives the same answer.
  traffic = read_traffic(str(timed_run))
  evidence = Evidence(worst_case=4.0, factor=2.2, window=300)
  for required in replay.required_factors(traffic):
    evidence.add_step(required, False)
  timings = traffic.timings
  for f, n, s in zip(timings.factors, timings.steps, timings.seconds):
    evidence.add_interval(f, n, s)
  evidence.add_step(replay.required_factors(traffic)[-1], False)  # prices from the next step
  assert evidence.advice.factor == out["pick"]


def test_a_measured_smaller_factor_is_named_only_within_the_fallback_bound(timed_run, capsys):
  """The frequency pick is never timed; 2.2, measured below it, falls back on at most half the
  steps: named, the reason saying the pick was never timed. With a bound below 2.2's share of
  fallbacks, the frequency pick is named instead."""
  out = answer(capsys, f"--workdir={timed_run}", "--window=0")
  rows = {r["factor"]: r for r in out["rows"]}
  frequency_pick = replay.advise(read_traffic(str(timed_run)), rule=factor_rule.Rule(),
                                 prices={}).factor
  assert 2.2 < frequency_pick and all(r["basis"] is None for f, r in rows.items()
                                      if f >= frequency_pick)
  assert out["pick"] == 2.2 and out["basis"] == "measured"
  assert out["reason"].endswith(f"{frequency_pick:g}, the smallest factor that falls back on at "
                                "most 1%, was never timed.")
  bound = rows[2.2]["fallback_frequency"] / 2
  strict = answer(capsys, f"--workdir={timed_run}", "--window=0",
                  f"--max_fallback_frequency={bound}")
  assert strict["pick"] == frequency_pick and strict["basis"] == "frequency"


def test_time_config_times_the_default_rows_and_the_rules_unpriced_pick(timed_run, capsys,
                                                                         monkeypatch):
  """`--time_config` (its compiles and timing stubbed: `capped_times` runs them) prices every
  row it timed 'timed', in place of the run's intervals; without --factors it times the
  default rows, the run's factors and the rule's unpriced pick."""
  calls = []
  def fake(config, traffic, factors, shards, steps, rounds):
    calls.append(list(factors))
    return {f: factor_rule.Price(0.1 + 0.05 * f, 0.001, "timed") for f in factors}
  monkeypatch.setattr(capacity, "capped_times", fake)
  out = answer(capsys, f"--workdir={timed_run}", "--window=0",
               "--time_config=launch/configs/tiny.py")
  [timed] = calls
  frequency_pick = replay.advise(read_traffic(str(timed_run)), rule=factor_rule.Rule(),
                                 prices={}).factor
  assert {*replay.DEFAULT_FACTORS, *SECONDS, frequency_pick} == set(timed)
  rows = {r["factor"]: r for r in out["rows"]}
  assert {f for f, r in rows.items() if r["basis"] == "timed"} == set(timed)
  # The timed steps grow with the factor: the fastest row that falls back on at most half
  # the steps beats the frequency pick by more than the noise.
  fastest = min((r for r in out["rows"] if r["fallback_frequency"] <= 0.5),
                key=lambda r: r["step_seconds"])
  assert out["pick"] == fastest["factor"] < frequency_pick and out["basis"] == "timed"


TIME_CONFIG = ("--time_config=launch/configs/tiny.py", "--time_config.mesh.fsdp=2",
               "--time_config.mesh.expert=4", "--time_config.data.seq_len=16")


@pytest.mark.slow  # two compiles of the tiny model: ~20 s
def test_time_config_times_each_factor_here_and_says_so_as_it_goes(timed_run, capsys):
  """The real timing: one capped program per factor (--factors, and the run's own factor
  added), compiled and timed on this machine, a progress line per factor compiled and per
  round."""
  out = answer(capsys, f"--workdir={timed_run}", "--factors=3", *TIME_CONFIG,
               "--time_steps=1", "--time_rounds=2")
  err = out["stderr"]
  rows = {r["factor"]: r for r in out["rows"]}
  assert {f for f, r in rows.items() if r["basis"] == "timed"} == {2.2, 3.0}
  assert all(rows[f]["step_seconds"] > 0 for f in (2.2, 3.0))
  for line in ("--time_config: compiled factor 3 (1 of 2)", "--time_config: compiled factor "
               "2.2 (2 of 2)", "--time_config: timed round 2 of 2 (2 factors x 1 steps)"):
    assert line in err, err
