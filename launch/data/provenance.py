"""Where `launch.prepare_data`'s token files came from, read back from `prepare_data.json`.

For the ArrayRecord files a run's `config.data.pattern` matches (in the launcher's sorted
order), `origins` gives each record's input file and `decoder` the text of token ids, with the
tokenizer the files were written with; both None where the metadata does not say.
"""
from __future__ import annotations

import json
import os
from typing import Callable

import numpy as np

METADATA = "prepare_data.json"  # beside the token files: tokenizer, vocabulary, inputs
BYTES = "bytes"  # the tokenizer name of one token per byte


def bytes_text(ids: np.ndarray) -> str:
  """Byte tokens `[n]` as text (bytes that are not UTF-8 replaced)."""
  return bytes(ids.astype(np.uint8)).decode("utf-8", "replace")


def _metadata(folder: str) -> dict | None:
  path = os.path.join(folder, METADATA)
  if not os.path.isfile(path):
    return None
  with open(path) as f:
    return json.load(f)


def origins(paths: list[str]) -> list[str] | None:
  """The input file of each record of `paths` (the stream's record order); None when a file
  is not listed in its folder's `prepare_data.json` (older metadata, another writer)."""
  found = []
  for path in paths:
    metadata = _metadata(os.path.dirname(path)) or {}
    entries = [e for e in metadata.get("files", []) if e["shard"] == os.path.basename(path)]
    if not entries:
      return None
    found += [e["path"] for e in sorted(entries, key=lambda e: e["record"])]
  return found


def decoder(paths: list[str]) -> Callable[[np.ndarray], str] | None:
  """Token ids `[n]` -> their text, with the tokenizer all of `paths` were written with; None
  when the folders do not name one tokenizer or its tokenizer.json is gone."""
  names = {(_metadata(os.path.dirname(p)) or {}).get("tokenizer") for p in paths}
  if len(names) != 1 or None in names:
    return None
  [name] = names
  if name == BYTES:
    return bytes_text
  if not os.path.isfile(name):
    return None
  import tokenizers  # only for tokenizer files
  loaded = tokenizers.Tokenizer.from_file(name)
  return lambda ids: loaded.decode(ids.tolist(), skip_special_tokens=False)
