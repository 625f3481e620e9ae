"""Training data: byte-level text from the Python standard library, or synthetic tokens.

Batches are a pure function of (seed, step): resuming at step n yields exactly the batches an
uninterrupted run would have seen. The corpus is the interpreter's own `.py` sources (present
on every machine, offline), read in sorted path order; its last `eval_fraction` is held out.
"""
from __future__ import annotations

import os
import sysconfig

import numpy as np

VOCAB_SIZE = 256  # bytes


def stdlib_corpus(max_bytes: int) -> np.ndarray:
  """The first `max_bytes` bytes of the standard library's `.py` files, as uint8 `[N]`."""
  root = sysconfig.get_paths()["stdlib"]
  chunks, total = [], 0
  for directory, subdirs, files in os.walk(root):
    subdirs.sort()
    subdirs[:] = [d for d in subdirs if d not in ("site-packages", "__pycache__")]
    for name in sorted(files):
      if name.endswith(".py") and total < max_bytes:
        with open(os.path.join(directory, name), "rb") as f:
          data = f.read(max_bytes - total)
        chunks.append(data)
        total += len(data)
  if total < max_bytes // 2:
    raise ValueError(f"the standard library under {root} holds only {total} bytes of .py "
                     f"sources; data.max_bytes={max_bytes} asks for more.")
  return np.frombuffer(b"".join(chunks), dtype=np.uint8)


class TokenData:
  """Windows of `seq_len + 1` tokens from a train and an eval split."""

  def __init__(self, tokens: np.ndarray, *, batch_size: int, seq_len: int, seed: int,
               eval_fraction: float = 0.05):
    split = int(len(tokens) * (1 - eval_fraction))
    self.train, self.eval = tokens[:split], tokens[split:]
    for name, part in (("train", self.train), ("eval", self.eval)):
      if len(part) <= seq_len + 1:
        raise ValueError(f"the {name} split has {len(part)} tokens, fewer than seq_len + 1 = "
                         f"{seq_len + 1}.")
    self.batch_size, self.seq_len, self.seed = batch_size, seq_len, seed

  def _windows(self, tokens: np.ndarray, key: tuple) -> np.ndarray:
    rng = np.random.default_rng((self.seed, *key))
    starts = rng.integers(0, len(tokens) - self.seq_len - 1, size=self.batch_size)
    return np.stack([tokens[s:s + self.seq_len + 1] for s in starts]).astype(np.int32)

  def train_batch(self, step: int) -> np.ndarray:
    """`[B, S + 1]` int32 for train step `step` (same step, same batch)."""
    return self._windows(self.train, (0, step))

  def eval_batch(self, index: int) -> np.ndarray:
    return self._windows(self.eval, (1, index))


def make_data(config) -> TokenData:
  """`config.data`: source ('stdlib' or 'synthetic'), max_bytes, batch_size, seq_len, seed."""
  d = config.data
  if d.source == "stdlib":
    tokens = stdlib_corpus(d.max_bytes)
  elif d.source == "synthetic":
    tokens = np.random.default_rng(d.seed).integers(0, VOCAB_SIZE, d.max_bytes, dtype=np.uint8)
  else:
    raise ValueError(f"data.source={d.source!r} must be 'stdlib' or 'synthetic'.")
  return TokenData(tokens, batch_size=d.batch_size, seq_len=d.seq_len, seed=d.seed)
