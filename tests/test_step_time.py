"""`launch.planning.step_model` and the planner's prices and pick (`launch.planning.replay`,
the factor rule of `metrics.factor_advice`) on intervals whose true step and chunk times are
known."""
import json
import re

import numpy as np
import pytest

from launch.errors import UserError
from launch.planning import replay, step_model as step_time
from metrics import factor_advice
from metrics.traffic import RunShape, Timings, Traffic, TrafficRecorder, read_traffic
from moe_hk import fallback
from tests.test_capacity import K, META, SHARDS, TOKENS, skewed_counts

# The matmul FLOPs are proportional to the true capped step (4 + f): scaled by them, the one
# measured factor prices every other exactly, so the truth below checks the prices.
FLOPS = step_time.StepFlops(fixed=4e9, per_factor=1e9, moe_layers=3)


def true_capped(factor):  # seconds: a step without fallback, linear in the buffer rows
  return 0.05 * (4 + factor)


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
  """With capped steps timed apart (`launch.planning.capped_timing`), a factor the run did not
  train at is the measured step times their ratio; a factor not timed falls back to the FLOPs."""
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


def true_step(traffic, factor: float) -> float:
  """Mean seconds per step at `factor` of the timed run's steps, by hand from the counts: a
  layer overflows when an expert shard receives more than floor(N f) rows; each overflowing
  layer runs the fewest chunks whose worst case fits that buffer."""
  n, layers = traffic.counts.shape[:2]
  rows = int(np.floor(TOKENS * K * factor))
  by_receiver = traffic.counts.reshape(n, layers, 2, SHARDS, SHARDS, 2)
  overflowing = (by_receiver.sum(axis=(3, 5)) > rows).any(axis=(2, 3))     # [n, layers]
  worst = lambda chunks: SHARDS * TOKENS // chunks * min(K, 2)
  chunks = next(c for c in range(1, SEQ + 1) if SEQ % c == 0 and worst(c) <= rows)
  return true_capped(factor) + overflowing.sum(axis=1).mean() * chunks * true_chunk(factor)


def test_planner_prices_factors_within_their_errors_and_picks_the_fastest_that_fits(timed_run):
  """Every factor's predicted seconds per step equal the independent truth within three
  standard errors (the run's intervals have 2% noise); the rule picks the truly fastest
  factor that falls back on at most half the steps, and under a memory budget the fastest
  that fits; a factor that does not fit, or falls back too often, is never named."""
  _, traffic = timed_run
  advice = replay.advise(traffic, max_frequency=0.5, target=0.01)
  assert advice.objective == "throughput"
  for c in advice.candidates:
    if c.factor < 1.0:  # no fallback fits a buffer below N: not priced
      assert not np.isfinite(c.seconds)
      continue
    assert abs(c.seconds - true_step(traffic, c.factor)) <= 3 * c.se, c
    assert 0 < c.se < 0.1 * c.seconds, c  # an error that says something
  admissible = [c for c in advice.candidates if np.isfinite(c.seconds)
                and c.fallback_frequency <= 0.5]
  fastest = min(admissible, key=lambda c: true_step(traffic, c.factor))
  assert advice.factor == fastest.factor != 1.5
  assert advice.reason.startswith(f"ragged_buffer_factor={fastest.factor:g}: the fewest ")
  # A budget that excludes it: the fastest of the rest.
  fits = lambda f: f < fastest.factor
  under = replay.advise(traffic, max_frequency=0.5, target=0.01, fits=fits)
  rest = min((c for c in admissible if fits(c.factor)), key=lambda c: c.seconds)
  assert under.factor == rest.factor
  assert replay.advise(traffic, max_frequency=0.5, target=0.01,
                       fits=lambda f: False).factor is None


def test_the_pick_never_falls_back_more_than_allowed(timed_run):
  """The default job's planner once picked factor 1, where the fallback ran on every step,
  because the FLOPs priced it cheapest. With intervals whose time does not depend on the
  chunks run (a chunk's time fits as 0), the factor whose fallback runs on every step is the
  cheapest; the rule still refuses it."""
  _, traffic = timed_run
  timings = traffic.timings
  cheap = traffic._replace(timings=timings._replace(seconds=timings.steps * true_capped(1.5)))
  advice = replay.advise(cheap, max_frequency=0.5, target=0.01)
  by_factor = {c.factor: c for c in advice.candidates}
  cheapest = min((c for c in advice.candidates if np.isfinite(c.seconds)),
                 key=lambda c: c.seconds)
  assert cheapest.factor == 1.0 and cheapest.fallback_frequency == 1.0
  assert advice.factor != cheapest.factor
  assert by_factor[advice.factor].fallback_frequency <= 0.5


def flat(factor):  # seconds: a capped step that grows 2% a unit of factor (the FLOPs: 25%)
  return 0.2 * (1 + 0.02 * factor)


@pytest.fixture(scope="module")
def flat_run(tmp_path_factory):
  """`make train`'s case: the timed run's traffic at factor 3, where nothing overflows, each
  file one interval of 10 steps timed by `flat` (1% noise)."""
  workdir = tmp_path_factory.mktemp("flat")
  counts = skewed_counts(3, 200)
  recorder = TrafficRecorder(str(workdir), **META,
                             shape=RunShape(SEQ, False, 0, FLOPS.fixed, FLOPS.per_factor))
  rng = np.random.default_rng(0)
  for first in range(0, 200, 10):
    seconds = 10 * flat(3.0) * (1 + 0.01 * rng.standard_normal())
    recorder.append(range(first, first + 10), counts[first:first + 10], [3.0] * 10,
                    np.zeros((10, 3), np.int32), seconds)
  return workdir, read_traffic(str(workdir))


def test_a_factor_priced_by_the_flops_alone_is_timed_not_named(flat_run):
  """The run measured one factor (3) and its capped step grows 2% a unit of factor, the
  FLOPs 25%. Scaled down, the FLOPs price a smaller buffer more than 3% cheaper: only a lower
  bound, so the rule names none and says which factor to time (the control: the same prices
  as estimates name it). Timed apart (--time_config), the trial saves about 1%: the answer is
  still to keep 3, and no lower bound is left."""
  _, run = flat_run
  advice = replay.advise(run, max_frequency=0.5, target=0.01)
  by_factor = {c.factor: c for c in advice.candidates}
  trial = by_factor[advice.trial]
  assert advice.factor is None and trial.factor < 3.0 and trial.lower_bound
  assert trial.fallback_frequency <= 0.5 and trial.seconds < 0.97 * by_factor[3.0].seconds
  assert advice.reason.startswith("the evidence cannot decide: ragged_buffer_factor="
                                  f"{trial.factor:g} may be faster than 3 ")
  assert "only a lower bound" in advice.reason and "inf" not in advice.reason
  assert all(c.lower_bound == (np.isfinite(c.seconds) and c.factor < 3.0)
             for c in advice.candidates)
  # The control: the same prices taken as estimates name the trial.
  price = replay.rule_price(run)
  named = factor_advice.advise(replay.required_factors(run), worst_case=4.0, current=3.0,
                               price=lambda f, layers: (*price(f, layers)[:2], False))
  assert named.factor == trial.factor
  timed = {trial.factor: flat(trial.factor), 3.0: flat(3.0)}
  again = replay.advise(run, max_frequency=0.5, target=0.01, factors=sorted(timed), timed=timed)
  assert again.factor is None and again.trial is None
  assert again.reason.startswith(f"the timings cannot separate ragged_buffer_factor="
                                 f"{trial.factor:g} ")
  assert again.reason.endswith("keep 3 or time more steps.")


def test_time_config_times_the_factor_the_evidence_says_to_time(flat_run, capsys, monkeypatch):
  """Without --factors, --time_config times the default rows, the run's factor and the trial
  the untimed rule names, and decides on those times (the compile and run replaced by the
  true capped step)."""
  from launch import capacity
  workdir, run = flat_run
  asked = []
  def capped_times(config, traffic, factors, *args):
    asked.extend(factors)
    return {f: flat(f) for f in [*factors, 3.0]}
  monkeypatch.setattr(capacity, "capped_times", capped_times)
  time_main(monkeypatch, f"--workdir={workdir}", *TIME_CONFIG)
  out = capsys.readouterr().out
  trial = replay.advise(run, max_frequency=0.5, target=0.01).trial
  assert sorted(asked) == sorted({*replay.DEFAULT_FACTORS, 3.0, trial})
  assert f"\n| {trial:g} | " in out and "pick: none (throughput): the timings cannot " in out
  assert "lower bound" not in out


def test_the_pick_is_none_when_the_timings_cannot_separate_it(timed_run):
  """With one timed interval the error is unknown: no factor is named over the run's own, and
  the reason says so (no `inf` printed)."""
  _, traffic = timed_run
  one = traffic.timings._replace(**{k: v[:1] for k, v in traffic.timings._asdict().items()})
  advice = replay.advise(traffic._replace(timings=one), max_frequency=1.0, target=0.01)
  assert advice.factor is None and "error unknown" in advice.reason
  assert "inf" not in advice.reason


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
    advice = replay.advise(run, max_frequency=0.5, target=0.01, factors=[1.5, 3.0])
    priced[recorded] = [(c.factor, c.seconds, c.se) for c in advice.candidates]
  np.testing.assert_allclose(priced[-1.0], priced[4.0], rtol=1e-12)
  assert [c[0] for c in priced[-1.0]] == [1.5, 3.0, 4.0]  # the factor in force joins


def test_cli_prints_the_prices_and_the_pick(timed_run, capsys):
  from tests.test_capacity import run_main
  workdir, _ = timed_run
  run_main(f"--workdir={workdir}", "--factors=1.5,2,3", "--window=0")
  out = capsys.readouterr().out
  header = next(line for line in out.splitlines() if line.startswith("| factor"))
  assert header.endswith("| s / step (predicted) | relative step time |")
  advice = replay.advise(read_traffic(str(workdir)), max_frequency=0.5, target=0.01,
                         factors=[1.5, 2, 3])
  assert f"\npick: {advice.factor:g} (throughput): {advice.reason}\n" in out
  assert "inf" not in out
  run_main(f"--workdir={workdir}", "--factors=1.5,2,3", "--format=json", "--window=0")
  results = json.loads(capsys.readouterr().out)
  assert [r["factor"] for r in results if r["pick"]] == [advice.factor]
  assert [r["relative_step_time"] for r in results][0] == 1.0
  # Regrouped for another expert-parallel size, the run's timings say nothing: unpriced.
  run_main(f"--workdir={workdir}", "--factors=1.5", "--expert_shards=2")
  assert "(fallback_frequency): " in capsys.readouterr().out


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
  out = capsys.readouterr()
  results = json.loads(out.out)
  timed = {r["factor"]: r["capped_step_seconds"] for r in results}
  assert set(timed) == {1.5, 3.0} and all(s > 0 for s in timed.values())
  # 3 is priced from the timed steps (scaled from the run's measured 1.5), not the FLOPs.
  window = replay.window(traffic, 100)
  again = replay.advise(window, max_frequency=0.5, target=0.01, factors=[1.5, 3.0], timed=timed)
  flops = replay.advise(window, max_frequency=0.5, target=0.01, factors=[1.5, 3.0])
  assert [r["step_seconds"] for r in results] == [c.seconds for c in again.candidates]
  assert again.candidates[1].seconds != flops.candidates[1].seconds
  # Its capped step is the run's 1.5 (true_capped, within the fit's error) times the timed
  # ratio: doubling the timed 3's step adds that once more, the chunks' price unchanged.
  ratio = timed[3.0] / timed[1.5]
  double = replay.advise(window, max_frequency=0.5, target=0.01, factors=[1.5, 3.0],
                         timed={1.5: timed[1.5], 3.0: 2 * timed[3.0]})
  added = double.candidates[1].seconds - again.candidates[1].seconds
  assert abs(added - true_capped(1.5) * ratio) <= 3 * again.candidates[0].se * ratio, (
      added, true_capped(1.5) * ratio)
  assert "--time_config: factors 3 priced from the capped steps timed here; 1.5 from the " \
         "run's own intervals" in out.err


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
