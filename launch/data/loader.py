"""Training data: byte-level text or pre-tokenised records, served as this process's rows.

Sources (`config.data.source`):
  'stdlib'        the interpreter's own `.py` sources (present on every machine, offline), read in
                  sorted path order, first `max_bytes` bytes; token = byte.
  'synthetic'     `max_bytes` uniform random bytes drawn from `seed`.
  'files'         the files matching the glob `config.data.pattern`, in sorted path order, read as
                  bytes (token = byte, vocabulary 256).
  'array_record'  ArrayRecord files matching `config.data.pattern`, in sorted path order. Each
                  record is one pre-tokenised sequence of any length: the raw bytes of a
                  little-endian int32 array, `np.asarray(tokens, '<i4').tobytes()`. Token ids must
                  lie in [0, config.vocab_size) (checked on every batch served).

'stdlib' and 'synthetic' draw windows at random starts; a batch is a pure function of
(seed, step), so their iterator state is trivial. 'files' and 'array_record' are grain pipelines
over one token stream (the files, or the records, concatenated in order; records are packed
across their boundaries with no separator) cut into consecutive windows of S + 1 tokens; a partial
last window is dropped. The last 5% of the windows (at least one) are held out for evaluation;
training windows are shuffled with `seed`, reshuffled each epoch and repeated forever. The train
batch of step `step` is rows [step * B, (step + 1) * B) of that sequence; process p reads only
its own rows [p * b, (p + 1) * b) of it, so the processes' batches, concatenated in process order,
are the global batch. Their train steps are served in order by a grain iterator whose state
(`get_state`/`set_state`) makes a resumed run see exactly the batches of an uninterrupted one.

Shapes: B global batch, b = B / process_count rows of this process, S sequence length,
W = S + 1 window, N tokens of a stream, Q pieces (files or records) of a stream.
"""
from __future__ import annotations

import copy
import dataclasses
import glob
import json
import os
import sysconfig
from typing import TYPE_CHECKING, Callable, Protocol

import numpy as np

from launch.data import provenance
from launch.setup.choices import DATA_SOURCES
from launch.setup.errors import UserError

# grain is imported only where it is used: `import grain` imports jax whenever jax is installed,
# and importing this module, or reading the byte sources, should import neither.
if TYPE_CHECKING:
  import grain

VOCAB_SIZE = 256  # bytes
SOURCES = DATA_SOURCES
EVAL_FRACTION = 0.05
# Each element a grain iterator prefetches is a whole [b, W] batch: a short queue bounds the
# host memory it holds, a few threads keep reads ahead of the train step.
_READ_OPTIONS = dict(num_threads=4, prefetch_buffer_size=4)
_SCAN_CHUNK = 4096  # records read per call while measuring an ArrayRecord stream


class Data(Protocol):
  """What the trainer reads: this process's rows of each global batch, and a resumable state."""
  vocab_size: int

  def train_batch(self, step: int) -> np.ndarray:
    """`[b, W]` int32: this process's rows of the global train batch of step `step`."""

  def eval_batch(self, index: int) -> np.ndarray:
    """`[b, W]` int32: this process's rows of held-out batch `index`."""

  def get_state(self) -> dict:
    """JSON-serialisable state after the last train batch served."""

  def set_state(self, state: dict) -> None:
    """Resumes from a `get_state()` of the same source."""

  def position(self, step: int) -> dict:
    """Where the global train batch of step `step` comes from: JSON, a row per window (its
    place in the source: file or record and offset), for alerts and `launch.batch`."""

  def global_batch(self, step: int) -> np.ndarray:
    """`[B, W]` int32: every process's rows of train step `step`'s batch (random access)."""


def stdlib_corpus(max_bytes: int) -> np.ndarray:
  """The first `max_bytes` bytes of the standard library's `.py` files, as uint8 `[N]`."""
  return stdlib_pieces(max_bytes)[0]


def stdlib_pieces(max_bytes: int) -> tuple[np.ndarray, list[str], list[int]]:
  """`stdlib_corpus`, the files it read, in order, and the bytes read of each."""
  root = sysconfig.get_paths()["stdlib"]
  chunks, paths, total = [], [], 0
  for directory, subdirs, files in os.walk(root):
    subdirs.sort()
    subdirs[:] = [d for d in subdirs if d not in ("site-packages", "__pycache__")]
    for name in sorted(files):
      if name.endswith(".py") and total < max_bytes:
        with open(os.path.join(directory, name), "rb") as f:
          data = f.read(max_bytes - total)
        chunks.append(data)
        paths.append(os.path.join(directory, name))
        total += len(data)
  if total < max_bytes // 2:
    raise ValueError(f"the standard library under {root} holds only {total} bytes of .py "
                     f"sources; data.max_bytes={max_bytes} asks for more.")
  return np.frombuffer(b"".join(chunks), dtype=np.uint8), paths, [len(c) for c in chunks]


def _place(offsets: np.ndarray, start: int, names: list[str] | None) -> dict:
  """A stream position as `{'file': path, 'offset': n}` (or `'record'`: q for ArrayRecord
  records, named by their index in the files' concatenation)."""
  piece = int(np.searchsorted(offsets, start, side="right")) - 1
  where = {"file": names[piece]} if names is not None else {"record": piece}
  return {**where, "offset": int(start - offsets[piece])}


def _check_source(state: dict, source: str) -> None:
  if state.get("source") != source:
    raise ValueError(f"the data state was saved by source {state.get('source')!r}; this run reads "
                     f"config.data.source={source!r}.")


def _check_processes(batch_size: int, process_index: int, process_count: int) -> None:
  """Raises unless the `process_count` processes can each hold b = batch_size / process_count."""
  if process_count < 1 or batch_size % process_count:
    raise ValueError(f"config.data.batch_size={batch_size} must be divisible by "
                     f"process_count={process_count}.")
  if not 0 <= process_index < process_count:
    raise ValueError(f"process_index={process_index} must be in [0, {process_count}).")


@dataclasses.dataclass(frozen=True)
class Batching:
  """How the data is cut into this process's batches."""
  batch_size: int        # global rows a step
  seq_len: int           # a row holds seq_len + 1 tokens
  seed: int
  process_index: int = 0
  process_count: int = 1
  eval_fraction: float = EVAL_FRACTION  # of the data held out for evaluation

  @property
  def rows(self) -> int:
    """This process's rows of each batch."""
    return self.batch_size // self.process_count


class TokenData:
  """Windows of `seq_len + 1` tokens at random starts in a train and an eval split; `files`
  and their `sizes` (None: synthetic) name where a token came from (`position`)."""

  def __init__(self, tokens: np.ndarray, batching: Batching, *, source: str,
               files: list[str] | None = None, sizes: list[int] | None = None):
    b = batching
    batch_size, seq_len, seed = b.batch_size, b.seq_len, b.seed
    split = int(len(tokens) * (1 - b.eval_fraction))
    # The files the tokens were read from (None: synthetic), for `position`.
    self._files = files
    self._offsets = None if files is None else _offsets(sizes)
    self.train, self.eval = tokens[:split], tokens[split:]
    for name, part in (("train", self.train), ("eval", self.eval)):
      if len(part) <= seq_len + 1:
        raise ValueError(f"the {name} split has {len(part)} tokens, fewer than seq_len + 1 = "
                         f"{seq_len + 1}.")
    self.batch_size, self.seq_len, self.seed, self.source = batch_size, seq_len, seed, source
    self._rows = slice(b.process_index * b.rows, (b.process_index + 1) * b.rows)
    self.vocab_size = VOCAB_SIZE

  def _starts(self, tokens: np.ndarray, key: tuple) -> np.ndarray:
    """`[B]`: the window starts of the `[B, W]` batch drawn for `key`. Every process draws all
    B, so its rows do not depend on the process count."""
    rng = np.random.default_rng((self.seed, *key))
    return rng.integers(0, len(tokens) - self.seq_len - 1, size=self.batch_size)

  def _windows(self, tokens: np.ndarray, starts: np.ndarray) -> np.ndarray:
    return np.stack([tokens[s:s + self.seq_len + 1] for s in starts]).astype(np.int32)

  def train_batch(self, step: int) -> np.ndarray:
    """`[b, W]` int32 for train step `step` (same step, same batch)."""
    return self._windows(self.train, self._starts(self.train, (0, step))[self._rows])

  def eval_batch(self, index: int) -> np.ndarray:
    """`[b, W]` int32 held-out batch `index`."""
    return self._windows(self.eval, self._starts(self.eval, (1, index))[self._rows])

  def global_batch(self, step: int) -> np.ndarray:
    return self._windows(self.train, self._starts(self.train, (0, step)))

  def position(self, step: int) -> dict:
    starts = self._starts(self.train, (0, step))
    rows = [{"start": int(s)} if self._files is None else
            {"start": int(s), **_place(self._offsets, int(s), self._files)} for s in starts]
    return {"source": self.source, "seed": self.seed, "step": step, "rows": rows}

  def get_state(self) -> dict:
    """Batches are a pure function of (seed, step): only the source is recorded."""
    return {"source": self.source}

  def set_state(self, state: dict) -> None:
    _check_source(state, self.source)


@dataclasses.dataclass(frozen=True)
class TokenStream:
  """A stream of N tokens stored in Q pieces (files or records), read by slices."""
  offsets: np.ndarray  # [Q + 1] int64: piece q holds stream tokens [offsets[q], offsets[q + 1])
  read: Callable[[int, int, int], np.ndarray]  # (q, start, stop) -> tokens [start, stop) of q
  names: list[str] | None = None  # the file of each piece (None: records, named by index)

  def __len__(self) -> int:
    return int(self.offsets[-1])

  def tokens(self, start: int, stop: int) -> np.ndarray:
    """Stream tokens [start, stop) as int32 `[stop - start]`, across piece boundaries."""
    piece = int(np.searchsorted(self.offsets, start, side="right")) - 1
    parts = []
    while start < stop:
      base, end = int(self.offsets[piece]), min(int(self.offsets[piece + 1]), stop)
      parts.append(self.read(piece, start - base, end - base))
      start, piece = end, piece + 1
    return np.concatenate(parts).astype(np.int32)


def _offsets(lengths: list[int]) -> np.ndarray:
  """`[Q + 1]` int64 start of each piece in the stream, then N."""
  return np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])


def _read_file(path: str, start: int, stop: int) -> np.ndarray:
  """Bytes [start, stop) of the file at `path`, as uint8 `[stop - start]`."""
  with open(path, "rb") as f:
    f.seek(start)
    return np.frombuffer(f.read(stop - start), dtype=np.uint8)


def file_stream(paths: list[str]) -> TokenStream:
  """The bytes of `paths`, concatenated in order."""
  return TokenStream(_offsets([os.path.getsize(p) for p in paths]),
                     lambda q, start, stop: _read_file(paths[q], start, stop), list(paths))


def _record_tokens(record: bytes, index: int) -> int:
  """The number of int32 tokens in record `index`."""
  if len(record) % 4:
    raise ValueError(f"ArrayRecord record {index} has {len(record)} bytes, not a multiple of 4; "
                     "records must be little-endian int32 arrays.")
  return len(record) // 4


def _check_array_records(paths: list[str], pattern: str) -> None:
  """ValueError naming the first of `paths` (matched by `pattern`) that is not an ArrayRecord
  file (the ArrayRecord reader fails on it)."""
  from array_record.python.array_record_module import ArrayRecordReader

  for path in paths:
    try:
      reader = ArrayRecordReader(path)
      reader.num_records()
      reader.close()
    except Exception:  # noqa: BLE001  (array_record raises RuntimeError for any failure)
      folder = os.path.dirname(path) or "."
      raise ValueError(f"config.data.pattern={pattern!r} matches {path}, which is not an "
                       f"ArrayRecord token file: narrow the pattern, e.g. "
                       f"'{os.path.join(folder, '*.array_record')}'.") from None


def array_record_stream(paths: list[str]) -> TokenStream:
  """The int32 records of the ArrayRecord files `paths`, concatenated in order.

  Measuring the stream reads every record once; only their lengths are kept."""
  import grain

  source = grain.sources.ArrayRecordDataSource(paths)
  lengths = []
  for first in range(0, len(source), _SCAN_CHUNK):
    records = source.__getitems__(range(first, min(first + _SCAN_CHUNK, len(source))))
    lengths += [_record_tokens(r, i) for i, r in enumerate(records, first)]
  return TokenStream(_offsets(lengths),
                     lambda q, start, stop: np.frombuffer(source[q], dtype="<i4")[start:stop])


def _batches(window: Callable[[int], np.ndarray], first: int, count: int, *, seed: int,
             rows: int, process_index: int, process_count: int) -> grain.MapDataset:
  """Process `process_index`'s `[b, W]` batches of windows first .. first + count - 1, shuffled
  and repeated forever: element k holds rows [k * B + p * b, k * B + (p + 1) * b) of the
  shuffled window sequence (batch by b, then every process_count-th batch from p)."""
  import grain

  return (grain.MapDataset.range(first, first + count).shuffle(seed=seed).repeat()
          .map(window).batch(rows).slice(slice(process_index, None, process_count)))


class GrainData:
  """Windows of a `TokenStream`: a grain iterator for training, random access for evaluation."""

  def __init__(self, stream: TokenStream, batching: Batching, *, source: str, what: str,
               vocab_size: int):
    """`what` names the stream in errors; token ids must be below `vocab_size`."""
    import grain

    b = batching
    batch_size, seed = b.batch_size, b.seed
    width = b.seq_len + 1
    windows = len(stream) // width
    if windows < 2:
      raise ValueError(f"{what} has {len(stream)} tokens; one train and one eval window of "
                       f"seq_len + 1 = {width} tokens need at least {2 * width}.")
    held_out = max(1, int(windows * b.eval_fraction))
    self.source, self.vocab_size = source, vocab_size

    def window(i: int) -> np.ndarray:  # [W]
      return stream.tokens(i * width, (i + 1) * width)

    split = dict(seed=seed, rows=b.rows, process_index=b.process_index,
                 process_count=b.process_count)
    train = _batches(window, 0, windows - held_out, **split)
    # Window k of the train sequence (batch s holds k in [s B, (s + 1) B)), for `position`.
    self._order = grain.MapDataset.range(0, windows - held_out).shuffle(seed=seed).repeat()
    self._window, self._width, self._stream = window, width, stream
    self._names = stream.names
    self.batch_size, self.seed = batch_size, seed
    self._iterator = iter(train.to_iter_dataset(grain.ReadOptions(**_READ_OPTIONS)))
    self._eval = _batches(window, windows - held_out, held_out, **split)
    self._step = 0

  def _checked(self, batch: np.ndarray) -> np.ndarray:
    """`batch`, after checking every token id is in [0, vocab_size) (a `UserError`: the data
    and the config disagree, whichever step finds it)."""
    bad = batch[(batch < 0) | (batch >= self.vocab_size)]
    if bad.size:
      raise UserError(f"token id {int(bad[0])} in the {self.source} data is outside "
                      f"[0, vocab_size={self.vocab_size}) (config.vocab_size): raise "
                      "config.vocab_size to the tokenizer's vocabulary.")
    return batch

  def train_batch(self, step: int) -> np.ndarray:
    """`[b, W]` int32 for train step `step`; steps are served in order (see `set_state`)."""
    if step != self._step:
      raise ValueError(f"train_batch({step}): the {self.source} data serves steps in order and "
                       f"expects step {self._step}; resume elsewhere with set_state.")
    batch = self._checked(next(self._iterator))
    self._step += 1
    return batch

  def eval_batch(self, index: int) -> np.ndarray:
    """`[b, W]` int32 held-out batch `index` (a pure function of seed and index)."""
    return self._checked(self._eval[index])

  def _windows_of(self, step: int) -> list[int]:
    return [int(self._order[k]) for k in range(step * self.batch_size,
                                               (step + 1) * self.batch_size)]

  def global_batch(self, step: int) -> np.ndarray:
    return self._checked(np.stack([self._window(k) for k in self._windows_of(step)]))

  def position(self, step: int) -> dict:
    rows = [{"window": k, **_place(self._stream.offsets, k * self._width, self._names)}
            for k in self._windows_of(step)]
    return {"source": self.source, "seed": self.seed, "step": step, "rows": rows}

  def get_state(self) -> dict:
    """The next step and grain's iterator state, after the last train batch served."""
    return {"source": self.source, "step": self._step,
            "iterator": copy.deepcopy(self._iterator.get_state())}

  def set_state(self, state: dict) -> None:
    """Resumes so that the next `train_batch` is step `state['step']`."""
    _check_source(state, self.source)
    self._iterator.set_state(copy.deepcopy(state["iterator"]))
    self._step = state["step"]


def _check_vocabulary(paths: list[str], vocab_size: int) -> None:
  """UserError when `launch.prepare_data` wrote `paths` with a larger vocabulary than
  `vocab_size` (its `prepare_data.json` beside them says)."""
  for folder in sorted({os.path.dirname(p) for p in paths}):
    metadata = os.path.join(folder, provenance.METADATA)
    if not os.path.isfile(metadata):
      continue
    with open(metadata) as f:
      prepared = json.load(f)
    if prepared.get("vocab_size", 0) > vocab_size:
      raise UserError(f"{folder} holds tokens of a vocabulary of {prepared['vocab_size']} ids "
                      f"(tokenizer {prepared.get('tokenizer')}); config.vocab_size={vocab_size} "
                      f"is smaller: pass --config.vocab_size={prepared['vocab_size']}.")


def matching_files(pattern: str, source: str) -> list[str]:
  """The files matching `pattern`, sorted."""
  if not pattern:
    raise ValueError(f"config.data.source={source!r} needs config.data.pattern, a glob of its "
                     "input files (e.g. '/data/*.txt').")
  paths = sorted(p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))
  if not paths:
    raise ValueError(f"config.data.pattern={pattern!r} matches no file.")
  return paths


def make_data(config, *, process_index: int = 0, process_count: int = 1) -> Data:
  """This process's data. `config.data`: source (one of SOURCES), pattern (a glob, for 'files'
  and 'array_record'), max_bytes ('stdlib', 'synthetic'), batch_size (global), seq_len, seed;
  `config.vocab_size` bounds the token ids of 'array_record'."""
  d = config.data
  _check_processes(d.batch_size, process_index, process_count)  # before reading any data
  batching = Batching(d.batch_size, d.seq_len, d.seed, process_index, process_count)
  names = sizes = None
  if d.source == "stdlib":
    tokens, names, sizes = stdlib_pieces(d.max_bytes)
  elif d.source == "synthetic":
    tokens = np.random.default_rng(d.seed).integers(0, VOCAB_SIZE, d.max_bytes, dtype=np.uint8)
  else:  # 'files' or 'array_record' (launch.setup.settings checked the source)
    paths = matching_files(d.pattern, d.source)
    as_bytes = d.source == "files"
    if not as_bytes:
      _check_array_records(paths, d.pattern)
      _check_vocabulary(paths, config.vocab_size)
    stream = file_stream(paths) if as_bytes else array_record_stream(paths)
    return GrainData(stream, batching, source=d.source,
                     what=f"config.data.pattern={d.pattern!r} ({len(paths)} file(s))",
                     vocab_size=VOCAB_SIZE if as_bytes else config.vocab_size)
  return TokenData(tokens, batching, source=d.source, files=names, sizes=sizes)
