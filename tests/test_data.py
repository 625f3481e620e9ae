"""launch.data.loader: shapes, per-process rows, exact resume and input errors for every
source."""
import json
import pathlib
import subprocess
import sys

import ml_collections
import numpy as np
import pytest

from launch.data import loader as data_lib

B, S = 4, 15  # global batch, sequence length: windows of W = 16 tokens
W = S + 1
VOCAB = 1000  # config.vocab_size of the array_record cases


def _config(source: str, pattern: str = "", **data) -> ml_collections.ConfigDict:
  fields = dict(source=source, pattern=pattern, max_bytes=200_000, batch_size=B, seq_len=S,
                seed=7)
  return ml_collections.ConfigDict(dict(vocab_size=VOCAB, data={**fields, **data}))


def _write_text(tmp_path, sizes=(3000, 1, 2500)) -> bytes:
  """Text files of `sizes` bytes; returns their concatenation in sorted path order."""
  rng = np.random.default_rng(0)
  parts = [bytes(rng.integers(32, 127, n, dtype=np.uint8)) for n in sizes]
  for i, part in enumerate(parts):
    (tmp_path / f"part{i}.txt").write_bytes(part)
  return b"".join(parts)


def _write_records(tmp_path, files=2, records=40) -> np.ndarray:
  """ArrayRecord files of int32 records of random lengths; returns all tokens `[N]` in order."""
  # Imported here, as the launcher does: collecting the suite needs no ArrayRecord writer.
  from array_record.python.array_record_module import ArrayRecordWriter
  rng = np.random.default_rng(1)
  tokens = []
  for f in range(files):
    writer = ArrayRecordWriter(str(tmp_path / f"shard{f}.array_record"), "group_size:1")
    for _ in range(records):
      record = rng.integers(0, VOCAB, rng.integers(0, 30), dtype=np.int32)
      writer.write(np.asarray(record, "<i4").tobytes())
      tokens.append(record)
    writer.close()
  return np.concatenate(tokens)


@pytest.fixture(params=["files", "array_record"])
def grain_source(request, tmp_path):
  """(config, the stream's tokens `[N]`) for each grain source."""
  if request.param == "files":
    stream = np.frombuffer(_write_text(tmp_path), np.uint8).astype(np.int32)
    return _config("files", str(tmp_path / "*.txt")), stream
  return _config("array_record", str(tmp_path / "*.array_record")), _write_records(tmp_path)


def test_shapes_dtype_and_token_range(grain_source):
  config, _ = grain_source
  data = data_lib.make_data(config)
  vocab = 256 if config.data.source == "files" else VOCAB
  assert data.vocab_size == vocab
  for batch in [data.train_batch(step) for step in range(3)] + [data.eval_batch(0)]:
    assert batch.shape == (B, W) and batch.dtype == np.int32
    assert 0 <= batch.min() and batch.max() < vocab


def test_windows_are_the_packed_stream_and_eval_is_held_out(grain_source):
  """Every row is a window [i * W, (i + 1) * W) of the concatenated stream: a train window for
  train batches, one of the last 5% (at least one) for eval batches."""
  config, stream = grain_source
  windows = stream[:len(stream) // W * W].reshape(-1, W)
  held_out = max(1, len(windows) // 20)
  index = {row.tobytes(): i for i, row in enumerate(windows)}
  data = data_lib.make_data(config)
  train = np.concatenate([data.train_batch(step) for step in range(10)])
  evals = np.concatenate([data.eval_batch(i) for i in range(3)])
  assert all(index[row.tobytes()] < len(windows) - held_out for row in train)
  assert all(index[row.tobytes()] >= len(windows) - held_out for row in evals)


def test_process_rows_concatenate_to_the_global_batch(grain_source):
  config, _ = grain_source
  whole = data_lib.make_data(config)
  halves = [data_lib.make_data(config, process_index=p, process_count=2) for p in range(2)]
  for step in range(4):
    parts = [h.train_batch(step) for h in halves]
    assert parts[0].shape == (B // 2, W)
    np.testing.assert_array_equal(np.concatenate(parts), whole.train_batch(step))
  np.testing.assert_array_equal(np.concatenate([h.eval_batch(2) for h in halves]),
                                whole.eval_batch(2))


def test_a_steps_position_and_global_batch_are_the_batches_served(grain_source):
  """`global_batch(step)` (random access, any step) equals the processes' served rows; each
  row's `position` points at the file (or record) and offset its tokens start at."""
  config, stream = grain_source
  halves = [data_lib.make_data(config, process_index=p, process_count=2) for p in range(2)]
  lookup = data_lib.make_data(config)
  width = S + 1
  for step in range(6):  # past the first epoch's end (the train split holds ~4 batches)
    served = np.concatenate([h.train_batch(step) for h in halves])
    np.testing.assert_array_equal(lookup.global_batch(step), served)
    position = lookup.position(step)
    assert (position["source"], position["seed"], position["step"]) == (config.data.source, 7,
                                                                        step)
    for row, where in zip(served, position["rows"]):
      np.testing.assert_array_equal(stream[where["window"] * width:][:width], row)
      assert ("file" in where) == (config.data.source == "files")
  json.dumps(position)  # it goes into alerts.jsonl


def test_byte_source_positions_name_the_file_and_offset():
  config = _config("stdlib")
  data = data_lib.make_data(config)
  position = data.position(3)
  np.testing.assert_array_equal(data.global_batch(3), data.train_batch(3))
  for row, where in zip(data.global_batch(3), position["rows"]):
    with open(where["file"], "rb") as f:
      f.seek(where["offset"])
      head = np.frombuffer(f.read(8), np.uint8)
    np.testing.assert_array_equal(row[:len(head)], head[:len(row)])


def test_exact_resume_from_json_state(grain_source):
  config, _ = grain_source
  data = data_lib.make_data(config)
  batches, state = [], None
  for step in range(5):
    batches.append(data.train_batch(step))
    if step == 2:
      state = json.loads(json.dumps(data.get_state()))
  resumed = data_lib.make_data(config)
  resumed.set_state(state)
  for step in (3, 4):
    np.testing.assert_array_equal(resumed.train_batch(step), batches[step])
  data.set_state(state)  # rewinds a live, prefetching iterator too
  np.testing.assert_array_equal(data.train_batch(3), batches[3])


def test_non_consecutive_step_raises(grain_source):
  config, _ = grain_source
  data = data_lib.make_data(config)
  data.train_batch(0)
  with pytest.raises(ValueError, match=r"train_batch\(5\).*expects step 1"):
    data.train_batch(5)


def test_epochs_repeat_and_reshuffle(tmp_path):
  """A corpus of few windows: every epoch serves each train window once, in a new order."""
  _write_text(tmp_path, sizes=(W * 21,))  # 21 windows: 20 train, 1 held out
  data = data_lib.make_data(_config("files", str(tmp_path / "*.txt")))
  rows = np.concatenate([data.train_batch(step) for step in range(10)])  # two epochs
  epochs = [[row.tobytes() for row in rows[e * 20:(e + 1) * 20]] for e in range(2)]
  assert len(set(epochs[0])) == 20 and set(epochs[0]) == set(epochs[1])
  assert epochs[0] != epochs[1]


def test_array_record_token_beyond_vocab_raises(tmp_path):
  _write_records(tmp_path)
  config = _config("array_record", str(tmp_path / "*.array_record"))
  config.vocab_size = 10
  with pytest.raises(ValueError, match=r"token id \d+ .*vocab_size=10"):
    data_lib.make_data(config).train_batch(0)


def test_state_of_another_source_is_rejected(tmp_path):
  _write_text(tmp_path)
  files = data_lib.make_data(_config("files", str(tmp_path / "*.txt")))
  stdlib = data_lib.make_data(_config("stdlib"))
  reads = "saved by source '{}'; this run reads config.data.source='{}'"
  with pytest.raises(ValueError, match=reads.format("files", "stdlib")):
    stdlib.set_state(files.get_state())
  with pytest.raises(ValueError, match=reads.format("stdlib", "files")):
    files.set_state(stdlib.get_state())


@pytest.mark.parametrize("source, pattern, data, message", [
    ("files", "{tmp}/none/*.txt", {}, r"config.data.pattern='.*/none/\*.txt' matches no file"),
    ("array_record", "", {}, r"config.data.source='array_record' needs config.data.pattern"),
    ("files", "{tmp}/*.txt", {}, r"has 0 tokens; .* need at least 32"),
    ("files", "{tmp}/small/*", {}, r"small/\*' \(1 file\(s\)\) has 20 tokens; .* need at least 32"),
    ("stdlib", "", {"batch_size": 6}, r"batch_size=6 must be divisible by process_count=4"),
])
def test_bad_input_is_a_one_line_value_error(tmp_path, source, pattern, data, message):
  (tmp_path / "empty.txt").write_bytes(b"")
  (tmp_path / "small").mkdir()
  (tmp_path / "small" / "one.txt").write_bytes(b"x" * 20)
  config = _config(source, pattern.format(tmp=tmp_path), **data)
  with pytest.raises(ValueError, match=message) as error:
    data_lib.make_data(config, process_count=4)
  assert "\n" not in str(error.value)


def _reference_windows(tokens: np.ndarray, seed: int, key: tuple) -> np.ndarray:
  """The batch the pre-grain TokenData drew: `[B, W]` windows at uniform random starts."""
  starts = np.random.default_rng((seed, *key)).integers(0, len(tokens) - W, size=B)
  return np.array([tokens[s:s + W] for s in starts], dtype=np.int32)


@pytest.mark.parametrize("source", ["stdlib", "synthetic"])
def test_byte_sources_unchanged(source):
  config = _config(source)
  data = data_lib.make_data(config)
  if source == "stdlib":
    tokens = data_lib.stdlib_corpus(config.data.max_bytes)
  else:
    tokens = np.random.default_rng(7).integers(0, 256, 200_000, dtype=np.uint8)
  split = int(len(tokens) * 0.95)
  halves = [data_lib.make_data(config, process_index=p, process_count=2) for p in range(2)]
  for step in (0, 3, 11):
    expected = _reference_windows(tokens[:split], 7, (0, step))
    np.testing.assert_array_equal(data.train_batch(step), expected)
    np.testing.assert_array_equal(np.concatenate([h.train_batch(step) for h in halves]), expected)
  np.testing.assert_array_equal(data.eval_batch(1), _reference_windows(tokens[split:], 7, (1, 1)))
  # Batches are a pure function of (seed, step): the state names only the source, survives
  # JSON, and a fresh reader restored from it serves the same batches; another source's state
  # is refused.
  state = json.loads(json.dumps(data.get_state()))
  assert state == {"source": source}
  resumed = data_lib.make_data(config)
  resumed.set_state(state)
  np.testing.assert_array_equal(resumed.train_batch(11), data.train_batch(11))
  other = "synthetic" if source == "stdlib" else "stdlib"
  with pytest.raises(ValueError, match=f"saved by source '{other}'; this run reads "
                                       f"config.data.source='{source}'"):
    resumed.set_state({"source": other})


def test_synthetic_numbers_pinned():
  """Values the pre-grain code produced (loss curves of other tests depend on them)."""
  config = _config("synthetic", batch_size=8, seq_len=32, seed=3)
  batch = data_lib.make_data(config).train_batch(3)
  assert batch[0, :8].tolist() == [84, 109, 16, 3, 7, 18, 217, 234]
  assert int(batch.sum()) == 32011
  assert data_lib.make_data(config).eval_batch(1)[0, :8].tolist() == [
      104, 60, 31, 146, 144, 216, 108, 13]


def test_import_does_not_import_jax():
  code = "import sys, launch.data.loader; assert 'jax' not in sys.modules, 'jax imported'"
  subprocess.run([sys.executable, "-c", code], check=True, cwd=pathlib.Path(__file__).parents[1])
