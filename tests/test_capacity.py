"""Recorded traffic (`metrics.traffic`) and the capacity planner (`launch.capacity`) against
explicit loops over steps, layers, expert groups and receivers."""
import io
import json
import math
import os
import re
import subprocess
import sys

import numpy as np
import pytest
from absl import app
from absl.testing import flagsaver

from launch import capacity
from launch.planning import replay
from launch.setup import cli as cli_lib
from launch.setup.errors import UserError
from metrics.traffic import Traffic, TrafficRecorder, read_traffic
from tests.helpers import ROOT

DEVICES, EXPERTS, SHARDS, TOKENS, K, LAYERS = 8, 8, 4, 16, 2, 3
META = dict(expert_shards=SHARDS, tokens_per_device=TOKENS, k=K)
FACTORS = (1.0, 1.25, 1.5, 2.0, 3.0, 4.0)  # 4 is the worst case here: it never overflows


def skewed_counts(seed: int, steps: int, layers: int = LAYERS) -> np.ndarray:
  """`[steps, layers, DEVICES, EXPERTS]`: each token picks K distinct experts (Gumbel top-k),
  pulled toward one hot expert per (step, layer) with a strength that varies by step."""
  rng = np.random.default_rng(seed)
  pull = rng.uniform(0, 3, (steps, layers, 1, 1, 1))
  hot = rng.integers(EXPERTS, size=(steps, layers, 1, 1, 1))
  logits = pull * (np.arange(EXPERTS) == hot) + rng.gumbel(
      size=(steps, layers, DEVICES, TOKENS, EXPERTS))
  chosen = np.argsort(-logits, axis=-1)[..., :K]  # [steps, layers, DEVICES, T, K]
  counts = (chosen[..., None] == np.arange(EXPERTS)).sum(axis=(-3, -2)).astype(np.int32)
  assert (counts.sum(-1) == TOKENS * K).all()
  return counts


def record(workdir, pieces, max_bytes: int = 1 << 30, **meta) -> None:
  """Appends `(first step, counts, factor per step or one for all)` pieces, one file each
  (no fallback, not timed)."""
  recorder = TrafficRecorder(str(workdir), **{**META, **meta}, max_bytes=max_bytes)
  for first, counts, factors in pieces:
    steps = range(first, first + len(counts))
    recorder.append(steps, counts, np.broadcast_to(factors, len(counts)), no_chunks(counts))


def no_chunks(counts) -> np.ndarray:
  """`fallback_chunks [n, layers]` of steps none of whose layers fell back."""
  return np.zeros(np.shape(counts)[:2], np.int32)


RUN_FACTORS = np.array([1.5] * 100 + [2.2] * 200)  # the run changed its factor at step 100


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  """A run of 300 steps recorded in two files, and its traffic."""
  workdir = tmp_path_factory.mktemp("run")
  counts = skewed_counts(0, 300)
  record(workdir, [(0, counts[:150], RUN_FACTORS[:150]), (150, counts[150:], RUN_FACTORS[150:])])
  return workdir, counts


def test_required_factors_are_each_layers_busiest_receiver(run):
  """The planner's evidence, computed by hand: per step and layer, the most rows any expert
  shard of any expert group receives, over N = T x K."""
  workdir, counts = run
  traffic = read_traffic(str(workdir))
  local = EXPERTS // SHARDS
  by_receiver = counts.reshape(300, LAYERS, DEVICES // SHARDS, SHARDS, SHARDS, local)
  received = by_receiver.sum(axis=(3, 5))  # [n, layers, groups, receivers]: senders, experts
  np.testing.assert_allclose(replay.required_factors(traffic),
                             received.max(axis=(2, 3)) / (TOKENS * K), rtol=1e-12)
  last = replay.window(traffic, 100)
  np.testing.assert_array_equal(last.steps, np.arange(200, 300))
  assert replay.window(traffic, 0) is traffic and replay.window(traffic, 500) is traffic


def test_round_trip(run):
  workdir, counts = run
  traffic = read_traffic(str(workdir))
  np.testing.assert_array_equal(traffic.steps, np.arange(300))
  np.testing.assert_array_equal(traffic.counts, counts)
  np.testing.assert_array_equal(traffic.factors, RUN_FACTORS)
  assert traffic.counts.dtype == np.int32 and traffic.steps.dtype == np.int64
  assert (traffic.expert_shards, traffic.tokens_per_device, traffic.k) == (SHARDS, TOKENS, K)
  assert sorted(os.listdir(workdir / "traffic")) == [
      "traffic-000000-000000000-000000149.npz", "traffic-000001-000000150-000000299.npz"]


def test_a_step_recorded_twice_keeps_the_newest_files_copy(tmp_path):
  first, resumed, again = skewed_counts(1, 200), skewed_counts(2, 100), skewed_counts(3, 50)
  # Steps 0-199, then a run resumed from step 150 records 150-249, then 0-49 are recorded anew.
  record(tmp_path, [(0, first[:100], 1.0), (100, first[100:], 1.0), (150, resumed, 2.0),
                    (0, again, 3.0)])
  traffic = read_traffic(str(tmp_path))
  np.testing.assert_array_equal(traffic.steps, np.arange(250))
  np.testing.assert_array_equal(traffic.counts,
                                np.concatenate([again, first[50:150], resumed]))
  np.testing.assert_array_equal(traffic.factors, [3.0] * 50 + [1.0] * 100 + [2.0] * 100)


def test_max_bytes_deletes_the_oldest_files(tmp_path):
  pieces = [(100 * i, skewed_counts(i, 100), 1.0) for i in range(5)]
  record(tmp_path / "one", pieces[:1])
  size = os.path.getsize(tmp_path / "one" / "traffic" / "traffic-000000-000000000-000000099.npz")
  record(tmp_path / "bounded", pieces, max_bytes=int(2.5 * size))
  traffic = read_traffic(str(tmp_path / "bounded"))
  np.testing.assert_array_equal(traffic.steps, np.arange(300, 500))
  np.testing.assert_array_equal(traffic.counts, np.concatenate([pieces[3][1], pieces[4][1]]))
  record(tmp_path / "tiny", pieces, max_bytes=1)  # the newest file stays whatever its size
  assert os.listdir(tmp_path / "tiny" / "traffic") == ["traffic-000004-000000400-000000499.npz"]


def balanced(steps: int, devices: int = DEVICES, experts: int = EXPERTS) -> np.ndarray:
  """`[steps, 1, devices, experts]` counts with every device's N = T * K rows spread evenly."""
  return np.full((steps, 1, devices, experts), TOKENS * K // experts, np.int32)


@pytest.mark.parametrize("steps,counts,factors,message", [
    ([0, 1], balanced(2), [1.0], "2 steps, 1 factors"),
    ([], balanced(0), [], "at least one"),
    ([1, 1], balanced(2), [1.0, 1.0], "increasing"),
    ([0], balanced(1)[0], [1.0], r"integer \[n, layers, devices, E\]"),
    ([0], balanced(1).astype(np.float32), [1.0], "integer"),
    ([0], balanced(1, devices=6), [1.0], "must divide the 6 devices"),
    ([0], balanced(1, experts=6), [1.0], "and the 6 experts"),
    ([0], balanced(1) + (np.arange(DEVICES)[:, None] == 0) * (np.arange(EXPERTS) == 0), [1.0],
     "= 32 rows .* sum to 32..33"),
])
def test_recorder_rejects_bad_input(tmp_path, steps, counts, factors, message):
  with pytest.raises(ValueError, match=message):
    TrafficRecorder(str(tmp_path), **META).append(steps, counts, factors, no_chunks(counts))


def test_recorder_rejects_chunks_of_another_shape(tmp_path):
  with pytest.raises(ValueError,
                     match=r"fallback_chunks \(2, 2\) must be \[n, layers\] = \(2, 1\)"):
    TrafficRecorder(str(tmp_path), **META).append([0, 1], balanced(2), [1.0, 1.0],
                                                   np.zeros((2, 2), np.int32))


def test_timings_round_trip(tmp_path):
  """Each timed, one-factor interval is one timing row; an untimed interval (NaN) and one
  whose factor changed inside are not; a file without timings still gives its traffic."""
  recorder = TrafficRecorder(str(tmp_path), **META)
  chunks = np.array([[0, 0, 0], [4, 0, 4], [0, 2, 0], [0, 0, 0]], np.int32)  # [4 steps, 3 layers]
  recorder.append(range(0, 4), skewed_counts(8, 4), [1.5] * 4, chunks, seconds=2.5)
  recorder.append(range(4, 8), skewed_counts(9, 4), [1.5] * 4, chunks)  # not timed
  recorder.append(range(8, 12), skewed_counts(10, 4), [1.5, 1.5, 2.0, 2.0], chunks, seconds=3.0)
  recorder.append(range(12, 14), skewed_counts(11, 2), [2.0] * 2, chunks[2:], seconds=1.0)
  damage(tmp_path, 4, 14, 17, npz(steps=np.arange(14, 18)))  # the format before timings
  traffic = read_traffic(str(tmp_path))
  np.testing.assert_array_equal(traffic.steps, np.arange(18))
  t = traffic.timings
  np.testing.assert_array_equal(t.factors, [1.5, 2.0])
  np.testing.assert_array_equal(t.steps, [4, 2])
  np.testing.assert_array_equal(t.fallback_steps, [2, 1])
  np.testing.assert_array_equal(t.chunks, [10, 2])
  np.testing.assert_array_equal(t.seconds, [2.5, 1.0])


def skip_warnings(caplog) -> list[str]:
  """The warnings logged for skipped traffic files."""
  return [r.getMessage() for r in caplog.records
          if r.levelname == "WARNING" and r.getMessage().startswith("Skipping traffic file")]


@pytest.mark.parametrize("second,message", [
    (dict(tokens_per_device=32, k=1),
     r"metadata \{'expert_shards': 4, 'tokens_per_device': 16, 'k': 2\} and counts \[layers, "
     r"devices, E\] \(3, 8, 8\) differ from the newest file's \{'expert_shards': 4, "
     r"'tokens_per_device': 32, 'k': 1\} \(3, 8, 8\)"),
    (dict(layers=2), r"\(3, 8, 8\) differ from the newest file's .* \(2, 8, 8\) "
                     r"\(traffic-000001-000000004-000000007.npz\)"),
], ids=["metadata", "layers"])
def test_read_skips_traffic_of_another_config(tmp_path, caplog, second, message):
  record(tmp_path, [(0, skewed_counts(0, 4), 1.0)])
  layers = second.pop("layers", LAYERS)
  newest = skewed_counts(1, 4, layers)
  record(tmp_path, [(4, newest, 1.0)], **second)
  traffic = read_traffic(str(tmp_path))
  np.testing.assert_array_equal(traffic.steps, np.arange(4, 8))
  np.testing.assert_array_equal(traffic.counts, newest)
  assert (traffic.tokens_per_device, traffic.k) == (second.get("tokens_per_device", TOKENS),
                                                    second.get("k", K))
  older = str(tmp_path / "traffic" / "traffic-000000-000000000-000000003.npz")
  assert traffic.skipped == (older,)
  (warning,) = skip_warnings(caplog)
  assert warning.startswith(f"Skipping traffic file {older}: ")
  assert re.search(message, warning), warning


def test_read_without_traffic_says_what_to_run(tmp_path):
  with pytest.raises(ValueError, match=r"traffic holds no recorded traffic: run .*launch.train"):
    read_traffic(str(tmp_path))
  (tmp_path / "traffic").mkdir()
  (tmp_path / "traffic" / "traffic-000000-000000000-000000009.npz.tmp").write_bytes(b"half")
  with pytest.raises(ValueError, match="holds no recorded traffic"):
    read_traffic(str(tmp_path))


def damage(workdir, seq: int, first: int, last: int, content: bytes) -> str:
  """Writes `content` as the traffic file numbered `seq` of steps first..last; its path."""
  path = workdir / "traffic" / f"traffic-{seq:06d}-{first:09d}-{last:09d}.npz"
  path.write_bytes(content)
  return str(path)


@pytest.fixture(scope="module")
def damaged(tmp_path_factory):
  """A run's traffic of steps 0-199 in two good files, a resumed run's copy of steps 150-249
  truncated and a file of random bytes; the workdir, the good counts and the two bad paths."""
  workdir = tmp_path_factory.mktemp("damaged")
  good = skewed_counts(4, 200)
  record(workdir, [(0, good[:100], 1.0), (100, good[100:], 1.0), (150, skewed_counts(5, 100), 2.0)])
  resumed = workdir / "traffic" / "traffic-000002-000000150-000000249.npz"
  truncated = damage(workdir, 2, 150, 249, resumed.read_bytes()[:1000])
  noise = damage(workdir, 3, 250, 299, np.random.default_rng(0).bytes(5000))
  return workdir, good, (truncated, noise)


def test_read_skips_a_truncated_and_a_random_file(damaged, caplog):
  workdir, good, bad = damaged
  traffic = read_traffic(str(workdir))
  np.testing.assert_array_equal(traffic.steps, np.arange(200))
  np.testing.assert_array_equal(traffic.counts, good)  # steps 150-199 from the readable copy
  np.testing.assert_array_equal(traffic.factors, np.ones(200))
  assert traffic.skipped == bad
  assert skip_warnings(caplog) == [
      f"Skipping traffic file {bad[0]}: truncated or corrupt zip (File is not a zip file).",
      f"Skipping traffic file {bad[1]}: not a zip file."]


def saved(save, *args, **kwargs) -> bytes:
  """What `save` (np.save, np.savez, np.savez_compressed) writes to a file."""
  f = io.BytesIO()
  save(f, *args, **kwargs)
  return f.getvalue()


def flipped(content: bytes, part: bytes) -> bytes:
  """`content` with the bits of the middle byte of its `part` inverted."""
  at = content.index(part) + len(part) // 2
  return content[:at] + bytes([content[at] ^ 0xFF]) + content[at + 1:]


# The arrays of a traffic file of steps 4-7, in the format: the cases below change one thing.
GOOD = dict(steps=np.arange(4, 8), counts=skewed_counts(6, 4), factors=np.ones(4),
            **{name: np.int64(value) for name, value in META.items()})


def npz(**changes: np.ndarray) -> bytes:
  """An .npz file of GOOD with `changes`."""
  return saved(np.savez, **{**GOOD, **changes})


@pytest.mark.parametrize("content,reason", [
    (b"", "not a zip file"),
    (npz()[:-100], r"truncated or corrupt zip \(File is not a zip file\)"),
    (flipped(npz(), GOOD["counts"].tobytes()),
     r"truncated or corrupt zip \(Bad CRC-32 for file 'counts.npy'\)"),
    (saved(np.save, GOOD["counts"]), "not a zip file"),
    (npz(steps=GOOD["steps"].astype(object)), "an array is not a plain numeric .npy"),
    (saved(np.savez, **{name: a for name, a in GOOD.items() if name not in ("counts", "k")}),
     "no counts, k array"),
    (npz(counts=GOOD["counts"].astype(np.int64)),
     r"counts is int64 \(4, 3, 8, 8\), not int32 of rank 4"),
    (npz(k=np.array([K])), r"k is int64 \(1,\), not int64 of rank 0"),
    (npz(factors=np.ones(3)),
     "4 steps, counts of 4 and 3 factors: need the same number, at least one"),
    (npz(steps=GOOD["steps"][:0], counts=GOOD["counts"][:0], factors=GOOD["factors"][:0]),
     "0 steps, counts of 0 and 0 factors"),
    (npz(fallback_chunks=np.zeros((4, 3)), seconds=np.float64(1.0)),
     r"fallback_chunks is float64 \(4, 3\), not int32 of rank 2"),
    (npz(fallback_chunks=np.zeros((4, 2), np.int32), seconds=np.float64(1.0)),
     r"fallback_chunks \(4, 2\) is not \[n, layers\] \(4, 3\)"),
], ids=["empty", "truncated", "bad_crc", "npy", "object_array", "missing_arrays", "int64_counts",
        "k_of_rank_1", "short_factors", "no_steps", "float_chunks", "chunks_of_2_layers"])
def test_read_skips_a_file_that_does_not_load(tmp_path, caplog, content, reason):
  record(tmp_path, [(0, skewed_counts(7, 4), 1.0)])
  bad = damage(tmp_path, 1, 4, 7, content)
  traffic = read_traffic(str(tmp_path))
  np.testing.assert_array_equal(traffic.steps, np.arange(4))
  assert traffic.skipped == (bad,)
  (warning,) = skip_warnings(caplog)
  assert re.fullmatch(f"Skipping traffic file {re.escape(bad)}: {reason}.*", warning), warning
  assert "allow_pickle" not in warning


def test_read_takes_the_unchanged_hand_made_file(tmp_path):
  """The files above differ from a readable one only where their reason says."""
  record(tmp_path, [(0, skewed_counts(7, 4), 1.0)])
  damage(tmp_path, 1, 4, 7, npz())
  traffic = read_traffic(str(tmp_path))
  np.testing.assert_array_equal(traffic.steps, np.arange(8))
  assert traffic.skipped == ()


def brute_force(traffic: Traffic, factor: float, shards: int) -> dict:
  """The planner's figures by walking every step, layer, expert group and receiver."""
  counts = traffic.counts.tolist()
  local = EXPERTS // shards
  rows = min(math.floor(TOKENS * K * factor), shards * TOKENS * min(K, local))
  fallback_steps = overflowing_layers = beyond = 0
  for step in counts:
    overflowing = 0
    for layer in step:
      overflow = False
      for group in range(DEVICES // shards):
        senders = layer[group * shards:(group + 1) * shards]
        for receiver in range(shards):
          load = sum(sum(sender[receiver * local:(receiver + 1) * local]) for sender in senders)
          beyond += max(load - rows, 0)
          overflow = overflow or load > rows
      overflowing += overflow
    fallback_steps += overflowing > 0
    overflowing_layers += overflowing
  steps = len(counts)
  return dict(factor=factor, fallback_frequency=fallback_steps / steps,
              overflowing_layers_mean=overflowing_layers / steps,
              would_drop_fraction=beyond / (steps * LAYERS * DEVICES * TOKENS * K),
              buffer_rows=rows, expert_shards=shards)


@pytest.mark.parametrize("shards", [None, 2, 8])
def test_plan_matches_explicit_loops(run, shards):
  traffic = read_traffic(str(run[0]))
  planned = replay.plan(traffic, FACTORS, shards)
  for got, factor in zip(planned, FACTORS, strict=True):
    want = brute_force(traffic, factor, shards or SHARDS)
    assert got.keys() == want.keys()
    for key in want:
      assert got[key] == pytest.approx(want[key], rel=1e-12), (factor, key)
  frequencies = [r["fallback_frequency"] for r in planned]
  assert frequencies[0] > 0 and frequencies[-1] == 0  # the traffic overflows only sometimes
  assert any(0 < f < 1 for f in frequencies)


@pytest.mark.parametrize("shards", [None, 2, 8])
def test_a_larger_buffer_never_falls_back_more(run, shards):
  factors = np.linspace(0.5, 4.5, 33)
  planned = replay.plan(read_traffic(str(run[0])), factors, shards)
  for key in ("fallback_frequency", "overflowing_layers_mean", "would_drop_fraction"):
    values = [r[key] for r in planned]
    assert values[0] > 0 and all(np.diff(values) <= 0), (key, values)


@pytest.mark.parametrize("shards,experts,message", [
    (3, 12, "expert_shards=3 must divide the 8 recorded devices"),
    (8, 12, "expert_shards=8 must divide the 12 experts"),
    (0, 8, "expert_shards=0 must divide"),
])
def test_plan_refuses_a_regrouping_that_does_not_divide(shards, experts, message):
  traffic = Traffic(np.arange(2), np.zeros((2, 1, DEVICES, experts), np.int32), np.ones(2),
                    expert_shards=4, tokens_per_device=TOKENS, k=K)
  with pytest.raises(ValueError, match=message):
    replay.plan(traffic, [1.0], shards)


def run_main(*args: str) -> None:
  """`launch.capacity`'s main in this process, with its flags restored afterwards."""
  with flagsaver.flagsaver():
    cli_lib.parse(["capacity", *args])
    capacity.main(["capacity"])


def cli(*args: str) -> subprocess.CompletedProcess:
  """`python -m launch.capacity ARGS` from the repository root."""
  return subprocess.run([sys.executable, "-m", "launch.capacity", *args], cwd=ROOT,
                        capture_output=True, text=True, timeout=300)


def test_cli_json_end_to_end(run):
  """The whole run (--window=0) replayed, no timings: the pick is the smallest factor (of
  1/8) that falls back on at most 1% of the steps, joined to the default rows; the JSON is
  one object with the pick, its reason and basis, the rows, and what produced it."""
  workdir, _ = run
  done = cli(f"--workdir={workdir}", "--format=json", "--window=0")
  assert done.returncode == 0, done.stderr[-3000:]
  answer = json.loads(done.stdout)
  assert {"command", "commit", "date", "machine", "pick", "reason", "basis",
          "window_steps", "rows"} == set(answer)
  assert answer["command"].startswith("python -m launch.capacity --workdir=")
  results = answer["rows"]
  replayed = {"factor", "fallback_frequency", "overflowing_layers_mean", "would_drop_fraction",
              "buffer_rows", "expert_shards"}
  assert all(r.keys() == replayed | {"step_seconds", "step_seconds_se", "basis",
                                     "relative_step_time", "pick"} for r in results)
  (picked,) = [r for r in results if r["pick"]]
  recorded = read_traffic(str(workdir))
  required = replay.required_factors(recorded)  # [steps, layers]
  covered = [f / 8 for f in range(1, 33) if np.mean((required > f / 8).any(axis=1)) <= 0.01]
  assert picked["factor"] == min(covered) and picked["step_seconds"] is None
  assert picked["basis"] is None and answer["pick"] == picked["factor"]
  assert answer["basis"] == "frequency" and answer["window_steps"] == 300
  # The run's factors and the pick join the default rows.
  factors = sorted({*replay.DEFAULT_FACTORS, 1.5, 2.2, picked["factor"]})
  assert [r["factor"] for r in results] == factors
  assert [{k: r[k] for k in replayed} for r in results] == replay.plan(recorded, factors)
  assert answer["reason"].startswith(
      f"use ragged_buffer_factor={picked['factor']:g}: the smallest factor that would have "
      "fallen back on at most 1% of the last 300 steps")
  with open(workdir / "capacity.png", "rb") as f:
    png = f.read()
  assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 20_000


def test_cli_table(run, capsys):
  run_main(f"--workdir={run[0]}", "--factors=2.2,1,1", "--expert_shards=2", "--window=0")
  out = capsys.readouterr().out
  assert out.startswith("300 steps (0..299), 3 MoE layers, 8 devices, E=8, T=16, K=2; expert "
                        "groups of P=2 (recorded with P=4); 0 files skipped\n")
  rows = [line for line in out.splitlines() if line.startswith("| ")]
  assert rows[0].startswith("| factor | buffer rows | fallback frequency |")
  assert [row.split(" | ")[0] for row in rows[1:]] == ["| 1", "| 2.2 (run, pick)"]


@pytest.mark.parametrize("args,message", [
    (["--factors=1,x"], "--factors=1,x: not a comma-separated list of numbers"),
    (["--factors=1,0"], "--factors=1,0: need one or more positive buffer factors"),
    (["--factors=inf"], "need one or more positive"),
    (["--factors="], "need one or more positive"),
    (["--factors=0.001"], "leaves a receive buffer of 0 rows"),
    (["--expert_shards=3"], "expert_shards=3 must divide the 8 recorded devices"),
    (["--aot_config=launch/configs/tiny.py"], "--aot_config and --compile_topology go together"),
    (["--memory_budget_gib=1"], "--memory_budget_gib=1 needs the compiled memory"),
    (["--memory_budget_gib=-2"], r"--memory_budget_gib=-2 must be >= 0"),
])
def test_cli_refuses_bad_input(run, args, message):
  with pytest.raises((app.UsageError, UserError), match=message):
    run_main(f"--workdir={run[0]}", *args)


def test_cli_without_traffic_fails_in_one_line(tmp_path):
  done = cli(f"--workdir={tmp_path}")
  assert done.returncode == 1 and "Traceback" not in done.stderr
  assert f"{tmp_path}/traffic holds no recorded traffic: run" in done.stderr.splitlines()[-1]


def test_cli_without_readable_traffic_fails_in_one_line(tmp_path, caplog):
  # A UsageError's message is the last line of stderr and the exit status 1, without a
  # traceback: test_cli_without_traffic_fails_in_one_line runs it.
  (tmp_path / "traffic").mkdir()
  bad = [damage(tmp_path, 0, 0, 9, b"PK\x03\x04 and then the end"),
         damage(tmp_path, 1, 10, 19, np.random.default_rng(1).bytes(100))]
  with pytest.raises((app.UsageError, UserError)) as raised:
    run_main(f"--workdir={tmp_path}")
  assert str(raised.value) == (
      f"{tmp_path}/traffic holds no readable traffic (2 files skipped): run `python -m "
      f"launch.train --workdir={tmp_path}` (with config.traffic.record=True, the default) "
      "first.")
  assert [w.split(": ")[0] for w in skip_warnings(caplog)] == [
      f"Skipping traffic file {path}" for path in bad]


def test_cli_skips_unreadable_files_with_a_warning_each(damaged):
  workdir, _, bad = damaged
  done = cli(f"--workdir={workdir}", "--factors=1,2")
  assert done.returncode == 0, done.stderr[-3000:]
  # The default window: the last 100 of the 200 readable steps.
  assert done.stdout.startswith("100 steps (100..199, the last 100 of the run), 3 MoE layers, "
                                "8 devices, E=8, T=16, K=2; expert groups of P=4 (recorded "
                                "with P=4); 2 files skipped\n")
  assert "Traceback" not in done.stderr and "allow_pickle" not in done.stderr
  for path, reason in zip(bad, ("truncated or corrupt zip (File is not a zip file)",
                                "not a zip file"), strict=True):
    (line,) = [line for line in done.stderr.splitlines() if path in line]
    assert line.startswith("W") and line.endswith(f"] Skipping traffic file {path}: {reason}.")


def test_memory_per_factor_regroups_the_mesh(run, monkeypatch):
  """Each factor compiles the config with that factor and P expert shards, fsdp the rest."""
  from launch.compiling import variants
  from launch.configs import tiny
  compiled = []

  def compile_variant(settings, devices, variant):
    factor = settings.layer.ragged_buffer_factor
    compiled.append((dict(settings.mesh), factor, variant, len(devices)))
    return {"total_bytes": int(1000 * factor)}

  monkeypatch.setattr(variants, "compile_variant", compile_variant)
  config, traffic = tiny.get_config(), read_traffic(str(run[0]))
  assert capacity.memory_per_factor(config, "cpu:8", [1.0, 2.5], 4, traffic) == [1000, 2500]
  assert compiled == [(dict(data=1, fsdp=2, expert=4), factor, "fallback_scan", 8)
                      for factor in (1.0, 2.5)]
  assert config.mesh.expert == 8 and config.moe.ragged_buffer_factor == 1.0  # left alone
  config.mesh.data = 3
  with pytest.raises(ValueError, match="data=3 x expert=4 does not divide the 8 devices"):
    capacity.memory_per_factor(config, "cpu:8", [1.0], 4, traffic)
  config.mesh.data, config.moe.num_experts_per_tok = 1, 1
  with pytest.raises(ValueError, match="--aot_config has 8 experts, top-1; the traffic 8, top-2"):
    capacity.memory_per_factor(config, "cpu:8", [1.0], 4, traffic)


def test_cli_picks_within_the_memory_budget(run, monkeypatch, capsys):
  """--memory_budget_gib against the compiled memory per factor (stubbed: 1 GiB per unit of
  factor; test_memory_per_factor_regroups_the_mesh and the test below compile it): the pick
  stays while it fits, to the byte; a budget just below it names no factor and says why."""
  workdir, _ = run
  monkeypatch.setattr(capacity, "memory_per_factor",
                      lambda config, topology, factors, shards, traffic:
                      [int(f * 2**30) for f in factors])

  def pick(*budget: str) -> tuple[list[float], list[dict], str]:
    run_main(f"--workdir={workdir}", "--format=json", "--window=0", "--compile_topology=cpu:8",
             "--aot_config=launch/configs/tiny.py", *budget)
    answer = json.loads(capsys.readouterr().out)
    results = answer["rows"]
    return [r["factor"] for r in results if r["pick"]], results, answer["reason"]

  (free,), results, _ = pick()
  assert all(r["memory_bytes_per_device"] == int(r["factor"] * 2**30) for r in results)
  assert pick(f"--memory_budget_gib={free}")[0] == [free]
  below, _, reason = pick(f"--memory_budget_gib={free - 0.01:g}")
  assert below == [] and reason.startswith("no factor that fits the memory budget falls back "
                                           "on at most 1% of the last")


@pytest.mark.slow
def test_cli_reports_the_compiled_memory(run):
  workdir, _ = run
  done = cli(f"--workdir={workdir}", "--format=json", "--factors=2",
             "--aot_config=launch/configs/tiny.py", "--compile_topology=cpu:8")
  assert done.returncode == 0, done.stderr[-3000:]
  (result,) = json.loads(done.stdout)["rows"]
  assert result["factor"] == 2 and result["memory_bytes_per_device"] > 0
  assert os.path.getsize(workdir / "capacity.png") > 20_000
