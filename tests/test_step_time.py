"""`launch.planning.step_model` and the planner's prices (`launch.planning.replay.price`,
`pick`) on intervals
whose true step and chunk times are known."""
import json
import re
import sys

import numpy as np
import pytest

from launch.errors import UserError
from launch import capacity
from launch.planning import replay, step_model as step_time
from metrics.traffic import RunShape, Timings, Traffic, TrafficRecorder, read_traffic
from moe_hk import fallback
from tests.test_capacity import K, META, SHARDS, TOKENS, skewed_counts

FLOPS = step_time.StepFlops(fixed=3e9, per_factor=1e9, moe_layers=3)


def true_capped(factor):  # seconds: a step without fallback, linear in the buffer rows
  return 0.2 + 0.05 * factor


def true_chunk(factor):   # seconds: one fallback chunk, proportional to its buffer rows
  return 0.01 * factor


def intervals(factor, chunks, noise=0.0, seed=0) -> Timings:
  """Intervals of 10 steps at `factor` with the given chunk totals, timed by the true model
  plus relative Gaussian `noise`."""
  chunks = np.asarray(chunks, np.int64)
  steps = np.full(len(chunks), 10, np.int64)
  seconds = steps * true_capped(factor) + chunks * true_chunk(factor)
  seconds = seconds * (1 + noise * np.random.default_rng(seed).standard_normal(len(chunks)))
  return Timings(np.full(len(chunks), factor), steps, np.minimum(chunks, steps), chunks, seconds)


def joined(*parts: Timings) -> Timings:
  return Timings(*(np.concatenate(columns) for columns in zip(*parts)))


def test_one_factor_fit_recovers_step_and_chunk_with_honest_errors():
  timings = intervals(2.0, [0, 4, 8, 2, 12, 6, 0, 10] * 3, noise=0.02)
  fit = step_time.fit_factor(timings, 2.0, chunk_prior=0.1)
  assert fit.intervals == 24
  for estimate, truth in ((fit.capped, true_capped(2.0)), (fit.chunk, true_chunk(2.0))):
    assert 0 < estimate.se < 0.2 * truth
    assert abs(estimate.seconds - truth) < 4 * estimate.se, (estimate, truth)
  exact = step_time.fit_factor(intervals(2.0, [0, 4, 8]), 2.0, chunk_prior=0.1)
  np.testing.assert_allclose([exact.capped.seconds, exact.chunk.seconds],
                             [true_capped(2.0), true_chunk(2.0)], rtol=1e-9)


def test_chunks_in_fixed_proportion_are_priced_by_the_flops_prior():
  """Every interval ran 5 chunks per 10 steps: step and chunk cannot be told apart, so a chunk
  costs the prior's fraction of a step; without any fallback, the step is the mean."""
  timings = intervals(2.0, [5, 5, 5, 5])
  prior = FLOPS.row_share(2.0) / FLOPS.moe_layers
  fit = step_time.fit_factor(timings, 2.0, chunk_prior=prior)
  assert fit.chunk is None
  per_step = timings.seconds[0] / 10
  np.testing.assert_allclose(fit.capped.seconds, per_step / (1 + prior * 0.5), rtol=1e-12)
  quiet = step_time.fit_factor(intervals(2.0, [0, 0, 0]), 2.0, chunk_prior=prior)
  np.testing.assert_allclose(quiet.capped.seconds, true_capped(2.0), rtol=1e-12)
  assert step_time.fit_factor(timings, 3.0, chunk_prior=prior) is None


def test_one_measured_factor_scales_by_flops_two_follow_the_line():
  one = step_time.StepTimeModel(intervals(2.0, [0, 4, 8, 2]), FLOPS)
  np.testing.assert_allclose(one.capped(3.0).seconds,
                             true_capped(2.0) * FLOPS.at(3.0) / FLOPS.at(2.0), rtol=1e-9)
  np.testing.assert_allclose(one.chunk(3.0).seconds, true_chunk(3.0), rtol=1e-9)
  # Two measured factors: the line through their fits, the FLOPs no longer used.
  two = step_time.StepTimeModel(joined(intervals(2.0, [0, 4, 8, 2], noise=1e-3),
                                       intervals(3.0, [0, 1, 3, 6], noise=1e-3, seed=1)), FLOPS)
  for factor in (1.0, 2.5, 4.0):
    estimate = two.capped(factor)
    assert abs(estimate.seconds - true_capped(factor)) < 4 * estimate.se + 1e-4
    np.testing.assert_allclose(two.chunk(factor).seconds, true_chunk(factor), rtol=0.05)
  step = two.step(2.5, chunks_per_step=1.5)
  np.testing.assert_allclose(step.seconds, true_capped(2.5) + 1.5 * true_chunk(2.5), rtol=0.01)
  with pytest.raises(ValueError, match="no timed interval"):
    step_time.StepTimeModel(intervals(2.0, []), FLOPS)


def test_timed_capped_steps_scale_one_measured_factor_in_place_of_the_flops():
  """With capped steps timed apart (`launch.planning.capped_timing`), a factor the run did not train at
  is the measured step times their ratio; a factor not timed falls back to the FLOPs."""
  timed = {2.0: 0.5, 3.0: 0.55, 4.0: 0.6}
  model = step_time.StepTimeModel(intervals(2.0, [0, 4, 8, 2]), FLOPS, timed)
  np.testing.assert_allclose(model.capped(2.0).seconds, true_capped(2.0), rtol=1e-9)
  for factor in (3.0, 4.0):
    np.testing.assert_allclose(model.capped(factor).seconds,
                               true_capped(2.0) * timed[factor] / timed[2.0], rtol=1e-9)
  np.testing.assert_allclose(model.capped(2.5).seconds,
                             true_capped(2.0) * FLOPS.at(2.5) / FLOPS.at(2.0), rtol=1e-9)


SEQ = 4  # TOKENS = 16 per device: 4 sequences of 4


@pytest.fixture(scope="module")
def timed_run(tmp_path_factory):
  """200 steps of skewed traffic at factor 1.5 with the fixed fallback, each file one interval
  of 10 steps timed by the true model (2% noise); the run shape of a 3-layer model."""
  workdir = tmp_path_factory.mktemp("timed")
  counts = skewed_counts(3, 200)
  shape = RunShape(SEQ, False, 0, FLOPS.fixed, FLOPS.per_factor)
  recorder = TrafficRecorder(str(workdir), **META, shape=shape)
  rng = np.random.default_rng(0)
  # The chunks the fixed fallback runs: the replay's overflowing layers x its chunk count.
  rows = replay.plan(Traffic(np.arange(200), counts, np.full(200, 1.5), **META),
                       [1.5])[0]["buffer_rows"]
  chunks = fallback.fallback_num_chunks(batch=TOKENS // SEQ, seq=SEQ, k=K, shards=SHARDS,
                                        local_experts=2, rows=rows)
  matrices = replay.group_traffic(counts, SHARDS)
  over = np.asarray(replay._overflow_rows(matrices.reshape(-1, SHARDS, SHARDS), rows))
  overflowing = (over.reshape(matrices.shape[:3]) > 0).any(axis=2)  # [steps, layers]
  for first in range(0, 200, 10):
    ran = (overflowing[first:first + 10] * chunks).astype(np.int32)
    seconds = 10 * true_capped(1.5) + ran.sum() * true_chunk(1.5)
    recorder.append(range(first, first + 10), counts[first:first + 10], [1.5] * 10, ran,
                    seconds * (1 + 0.02 * rng.standard_normal()))
  return workdir, read_traffic(str(workdir))


def test_recorded_shape_and_timings_round_trip(timed_run):
  _, traffic = timed_run
  assert traffic.shape == RunShape(SEQ, False, 0, FLOPS.fixed, FLOPS.per_factor)
  assert len(traffic.timings.seconds) == 20 and traffic.timings.chunks.sum() > 0


def test_planner_prices_factors_within_their_errors_and_picks_the_fastest_that_fits(timed_run):
  """At the run's factor the prediction is the measured mean; the chunk time it fits is the
  truth's; the pick is the cheapest predicted factor, or under a budget the cheapest that fits."""
  _, traffic = timed_run
  results = replay.plan(traffic, [1.0, 1.5, 2.0, 3.0])
  assert replay.price(traffic, results)
  at_run = next(r for r in results if r["factor"] == 1.5)
  assert at_run["relative_step_time"] == 1.0
  measured = traffic.timings.seconds.sum() / traffic.timings.steps.sum()
  assert abs(at_run["step_seconds"] - measured) < 3 * at_run["step_seconds_se"] + 1e-3
  for r in results:
    assert r["step_seconds"] > 0 and r["step_seconds_se"] > 0
  fastest = min(results, key=lambda r: r["step_seconds"])
  assert replay.pick(results, None) is fastest
  memory = {1.0: 10, 1.5: 15, 2.0: 20, 3.0: 30}
  for r in results:
    r["memory_bytes_per_device"] = memory[r["factor"]]
  budget = memory[fastest["factor"]] - 1  # excludes the fastest
  chosen = replay.pick(results, budget)
  assert chosen["memory_bytes_per_device"] <= budget
  assert chosen["step_seconds"] == min(r["step_seconds"] for r in results
                                       if r["memory_bytes_per_device"] <= budget)
  assert replay.pick(results, 1) is None


def test_a_run_at_the_worst_case_is_priced_at_its_factor(timed_run):
  """A run at factor -1 (the worst-case buffer; 4 here) prices every factor as the same
  timings recorded at 4 would: the model sizes the buffer by the worst case's factor."""
  _, traffic = timed_run
  timings = traffic.timings
  priced = {}
  for recorded in (-1.0, 4.0):
    run = traffic._replace(factors=np.full_like(traffic.factors, recorded),
                           timings=timings._replace(factors=np.full_like(timings.factors,
                                                                         recorded)))
    results = replay.plan(run, [1.5, 3.0, recorded])
    assert replay.price(run, results)
    priced[recorded] = [(r["step_seconds"], r["relative_step_time"]) for r in results]
  np.testing.assert_allclose(priced[-1.0], priced[4.0], rtol=1e-12)
  assert priced[-1.0][-1][1] == 1.0 and priced[-1.0][0][0] < priced[-1.0][-1][0]


def test_cli_prints_the_prices_and_the_pick(timed_run, capsys):
  from tests.test_capacity import run_main
  workdir, _ = timed_run
  run_main(f"--workdir={workdir}", "--factors=1.5,2,3")
  out = capsys.readouterr().out
  header = next(line for line in out.splitlines() if line.startswith("| factor"))
  assert header.endswith("| s / step (predicted) | relative step time |")
  assert "pick: factor " in out and "s/step predicted" in out
  run_main(f"--workdir={workdir}", "--factors=1.5,2,3", "--format=json")
  results = json.loads(capsys.readouterr().out)
  assert sum(r["pick"] for r in results) == 1
  assert [r["relative_step_time"] for r in results][0] == 1.0
  # Regrouped for another expert-parallel size, the run's timings say nothing: no prices.
  run_main(f"--workdir={workdir}", "--factors=1.5", "--expert_shards=2")
  assert "pick: none (the run recorded no step timings for this expert-parallel size)" in (
      capsys.readouterr().out)


# The tiny model shaped like the timed run: P=4 expert shards, T=16 tokens per device.
TIME_CONFIG = ("--time_config=launch/configs/tiny.py", "--time_config.mesh.fsdp=2",
               "--time_config.mesh.expert=4", "--time_config.data.seq_len=16")


def time_main(monkeypatch, *args: str) -> None:
  """`launch.capacity`'s main in this process."""
  from tests.test_capacity import run_main
  run_main(*args)


@pytest.mark.slow  # two compiles of the tiny model and TensorFlow's import: ~20 s
def test_the_planner_times_capped_steps_and_prices_with_them(timed_run, capsys, monkeypatch):
  """--time_config compiles and times the run's config per factor (the run's own included)
  and prices every factor from those times: what `price` gives with them."""
  workdir, traffic = timed_run
  time_main(monkeypatch, f"--workdir={workdir}", "--factors=1.5,3", "--format=json",
            *TIME_CONFIG, "--time_steps=1", "--time_rounds=1")
  results = json.loads(capsys.readouterr().out)
  timed = {r["factor"]: r["capped_step_seconds"] for r in results}
  assert set(timed) == {1.5, 3.0} and all(s > 0 for s in timed.values())
  again = replay.plan(traffic, [1.5, 3.0])
  assert replay.price(traffic, again, timed)
  assert [r["step_seconds"] for r in results] == [r["step_seconds"] for r in again]


@pytest.mark.parametrize("overrides,message", [
    (("--time_config.mesh.fsdp=1", "--time_config.mesh.expert=8"),
     "--time_config runs P=8 expert shards with T=16 tokens per device and prices P=4; the "
     "run recorded P=4, T=16"),
    (("--time_config.moe.num_experts_per_tok=1",), "--time_config has 8 experts, top-1"),
    (("--time_steps=0",), "--time_steps=0 and --time_rounds=10 must be >= 1"),
])
def test_the_planner_refuses_a_timing_config_that_is_not_the_runs(timed_run, overrides,
                                                                   message, monkeypatch):
  from absl import app
  with pytest.raises((app.UsageError, UserError), match=re.escape(message)):
    time_main(monkeypatch, f"--workdir={timed_run[0]}", *TIME_CONFIG, *overrides)
