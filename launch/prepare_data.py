r"""Tokenizes text files into the launcher's ArrayRecord token files.

  python -m launch.prepare_data --input='/data/text/*.txt' --output=/data/tokens \
      [--tokenizer=bytes|PATH/tokenizer.json] [--shards=8]

Each input file (sorted by path) becomes one record: its tokens as a little-endian int32
array (`np.asarray(tokens, '<i4').tobytes()`), the format `config.data.source='array_record'`
reads (`launch.data.loader`), written in order over `--shards` files
`OUTPUT/tokens-SSSSS-of-NNNNN.array_record`, so that the launcher, reading them in sorted path
order, sees the files in their sorted order. `--tokenizer=bytes` makes each byte a token
(vocabulary 256); a path names a Hugging Face `tokenizer.json`, read offline with the
`tokenizers` library. `OUTPUT/prepare_data.json` records the tokenizer, its vocabulary size,
the counts, and each input file with the shard, record and tokens it became (`files`, for
`launch.batch`, which prints a batch's rows as text with their file and offset); the
launcher refuses a `config.vocab_size` smaller than that vocabulary before it compiles. Then
train with

  .venv/bin/python -m launch.train --workdir=DIR --config.data.source=array_record \
      --config.data.pattern='/data/tokens/*.array_record' --config.vocab_size=V
"""
import glob
import json
import os
import sys
from typing import Callable, Sequence, TextIO

import numpy as np
from absl import flags

from launch.data.provenance import BYTES, METADATA
from launch.setup import cli
from launch.setup.errors import UserError


_INPUT = flags.DEFINE_string("input", None, "Glob of the text files to tokenize (quote it).",
                             required=True)
_OUTPUT = flags.DEFINE_string("output", None, "Folder for the ArrayRecord token files (created; "
                              "must hold no token files yet).", required=True)
_TOKENIZER = flags.DEFINE_string("tokenizer", BYTES, "'bytes' (one token per byte, vocabulary "
                                 "256) or the path of a tokenizer.json (Hugging Face tokenizers).")
_SHARDS = flags.DEFINE_integer("shards", 1, "ArrayRecord files to spread the records over.")


def tokenizer(spec: str) -> tuple[Callable[[bytes], np.ndarray], int, str]:
  """(bytes -> token ids, vocabulary size, a name for the metadata) of `--tokenizer`."""
  if spec == BYTES:
    return lambda data: np.frombuffer(data, np.uint8).astype(np.int32), 256, BYTES
  if not os.path.isfile(spec):
    raise UserError(f"--tokenizer={spec}: no such file; pass 'bytes' or the path of a "
                    "tokenizer.json.")
  import tokenizers  # only for tokenizer files
  try:
    loaded = tokenizers.Tokenizer.from_file(spec)
  except Exception as e:  # noqa: BLE001  (tokenizers' own error types)
    raise UserError(f"--tokenizer={spec}: not a tokenizer.json the tokenizers library reads "
                    f"({type(e).__name__}: {str(e).splitlines()[0][:200]}).") from None
  encode = lambda data: np.asarray(loaded.encode(data.decode("utf-8", "replace")).ids, np.int32)
  return encode, loaded.get_vocab_size(), os.path.abspath(spec)


def inputs(pattern: str, output: str) -> list[str]:
  """The files `pattern` matches, sorted; UserError when none, or when `output` already holds
  token files (they would mix with the new ones)."""
  paths = sorted(p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))
  if not paths:
    raise UserError(f"--input={pattern!r} matches no file.")
  if glob.glob(os.path.join(output, "*.array_record")):
    raise UserError(f"--output={output} already holds .array_record files: pass an empty or "
                    "new folder.")
  return paths


def shard_path(output: str, shard: int, shards: int) -> str:
  return os.path.join(output, f"tokens-{shard:05d}-of-{shards:05d}.array_record")


def _progress(stream: TextIO, done: int, total: int, tokens: int) -> None:
  """`prepare_data: 2/5 files, 11,358 tokens`: rewritten in place on a terminal; in a log a
  line at each tenth of the files."""
  text = f"prepare_data: {done}/{total} files, {tokens:,} tokens"
  if stream.isatty():
    stream.write(f"\r{text}" + ("\n" if done == total else ""))
  elif done * 10 // total != (done - 1) * 10 // total:
    stream.write(text + "\n")
  stream.flush()


def write(paths: Sequence[str], output: str, encode: Callable[[bytes], np.ndarray],
          shards: int, progress: TextIO = sys.stderr) -> dict:
  """Writes one record per input file over `shards` files, in order; returns the counts and
  `files`: each input's path, shard file, record index in that shard and token count."""
  from array_record.python.array_record_module import ArrayRecordWriter
  os.makedirs(output, exist_ok=True)
  writers = [ArrayRecordWriter(shard_path(output, s, shards), "group_size:1")
             for s in range(shards)]
  tokens, largest, files, in_shard = 0, -1, [], [0] * shards
  try:
    for i, path in enumerate(paths):
      with open(path, "rb") as f:
        ids = encode(f.read())
      shard = i * shards // len(paths)
      writers[shard].write(np.asarray(ids, "<i4").tobytes())
      files.append({"path": os.path.abspath(path),
                    "shard": os.path.basename(shard_path(output, shard, shards)),
                    "record": in_shard[shard], "tokens": len(ids)})
      in_shard[shard] += 1
      tokens += len(ids)
      largest = max(largest, int(ids.max(initial=-1)))
      _progress(progress, i + 1, len(paths), tokens)
  finally:
    for w in writers:
      w.close()
  return {"records": len(paths), "tokens": tokens, "largest_id": largest, "files": files}


def main(argv):
  del argv  # launch.setup.cli refuses arguments that are not flags
  if _SHARDS.value < 1:
    raise UserError(f"--shards={_SHARDS.value} must be >= 1.")
  paths = inputs(_INPUT.value, _OUTPUT.value)
  encode, vocab_size, name = tokenizer(_TOKENIZER.value)
  shards = min(_SHARDS.value, len(paths))
  try:
    counts = write(paths, _OUTPUT.value, encode, shards)
  except OSError as e:
    raise UserError(f"--output={_OUTPUT.value}: cannot write there ({e.strerror or e}).") from None
  metadata = {"tokenizer": name, "vocab_size": vocab_size, "shards": shards, **counts,
              "inputs": len(paths)}
  with open(os.path.join(_OUTPUT.value, METADATA), "w") as f:
    json.dump(metadata, f, indent=2)
  print(f"wrote {counts['records']} records, {counts['tokens']:,} tokens, in {shards} "
        f"file{'s' * (shards > 1)} to {_OUTPUT.value} (vocabulary {vocab_size}); train with "
        f"--config.data.source=array_record --config.data.pattern='"
        f"{os.path.join(_OUTPUT.value, '*.array_record')}' --config.vocab_size={vocab_size}")


if __name__ == "__main__":
  cli.run(main)
