"""What `launch.batch` prints of one step's batch: each row's origin and its leading tokens."""
from __future__ import annotations

from typing import Callable, NamedTuple

import numpy as np

from launch.data import loader as data_lib, provenance


class Source(NamedTuple):
  """How rows are named and shown: each record's input file (None: by record index) and the
  text of ids (None: ids as numbers)."""
  origins: list[str] | None
  text: Callable[[np.ndarray], str] | None


def source(config, ids: bool) -> Source:
  """The `Source` of `config.data`: byte sources as text; prepared token files by their
  `prepare_data.json`."""
  if config.data.source != "array_record":
    return Source(None, None if ids else provenance.bytes_text)
  paths = data_lib.matching_files(config.data.pattern, config.data.source)
  return Source(provenance.origins(paths), None if ids else provenance.decoder(paths))


def _origin(where: dict, origins: list[str] | None) -> str:
  """`file:offset` (byte sources, token files with their inputs recorded), else the record."""
  if "file" in where:
    return f"{where['file']}:{where['offset']}"
  if "record" not in where:
    return f"stream offset {where['start']}"
  if origins is None:
    return f"record {where['record']} + token {where['offset']}"
  return f"{origins[where['record']]} token {where['offset']} (record {where['record']})"


def describe(position: dict, batch: np.ndarray, rows: int, tokens: int, shown_as: Source
             ) -> list[str]:
  """The lines `launch.batch` prints for one step's `position` and `batch [B, W]`."""
  lines = [f"step {position['step']}: {batch.shape[0]} rows x {batch.shape[1]} tokens from "
           f"source {position['source']!r} (seed {position['seed']})"]
  shown = range(len(position["rows"]) if rows == 0 else min(rows, len(position["rows"])))
  for r in shown:
    where, head = position["rows"][r], batch[r, :tokens]
    window = f" (window {where['window']})" if "window" in where else ""
    text = (repr(shown_as.text(head)) if shown_as.text else " ".join(map(str, head.tolist())))
    lines.append(f"row {r}: {_origin(where, shown_as.origins)}{window}: {text}")
  if len(shown) < batch.shape[0]:
    lines.append(f"... {batch.shape[0] - len(shown)} more rows (--rows=0 prints all)")
  return lines
