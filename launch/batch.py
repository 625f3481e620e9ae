"""Prints the global batch of one train step of a run: where each row came from and its tokens.

  python -m launch.batch --workdir=DIR --step=N [--rows=8] [--tokens=48]

A skipped step's alert (`nonfinite_step`, `loss_spike` in DIR/alerts.jsonl) names its step and
`data_position`; this rebuilds that step's batch from the run's data config (DIR/config.json,
written by `launch.train`), as the data pipeline served it: a pure function of the seed and
the step (the grain sources' shuffled window order, which their checkpointed iterator state
points into). Each row: its window's source (file and byte offset, or ArrayRecord record and
token offset) and its first tokens (bytes as text for the byte sources, ids otherwise).
"""
import numpy as np
from absl import flags

from launch import cli, settings
from launch.errors import UserError, user_errors
from launch.training import checkpoints, data as data_lib

_WORKDIR = flags.DEFINE_string("workdir", None, "Workdir of a launch.train run.", required=True)
_STEP = flags.DEFINE_integer("step", None, "The train step whose batch to print (0-based, as "
                             "alerts name it).", required=True)
_ROWS = flags.DEFINE_integer("rows", 8, "Rows to print (0: all).")
_TOKENS = flags.DEFINE_integer("tokens", 48, "Leading tokens to print of each row.")


def show_tokens(row: np.ndarray, byte_tokens: bool) -> str:
  """`row`'s tokens: as text (Python escapes for bytes that are not printable) for byte
  sources, as ids otherwise."""
  if byte_tokens:
    return repr(bytes(row.astype(np.uint8)).decode("latin-1"))
  return " ".join(map(str, row.tolist()))


def describe(position: dict, batch: np.ndarray, rows: int, tokens: int) -> list[str]:
  """The lines `launch.batch` prints for one step's `position` and `batch [B, W]`."""
  byte_tokens = position["source"] != "array_record"
  lines = [f"step {position['step']}: {batch.shape[0]} rows x {batch.shape[1]} tokens from "
           f"source {position['source']!r} (seed {position['seed']})"]
  shown = range(len(position["rows"]) if rows == 0 else min(rows, len(position["rows"])))
  for r in shown:
    where = position["rows"][r]
    origin = (f"{where['file']}:{where['offset']}" if "file" in where else
              f"record {where['record']} + {where['offset']}" if "record" in where else
              f"stream offset {where['start']}")
    window = f" (window {where['window']})" if "window" in where else ""
    lines.append(f"row {r}: {origin}{window}: {show_tokens(batch[r, :tokens], byte_tokens)}")
  if len(shown) < batch.shape[0]:
    lines.append(f"... {batch.shape[0] - len(shown)} more rows (--rows=0 prints all)")
  return lines


def main(argv):
  del argv  # launch.cli refuses arguments that are not flags
  if _STEP.value < 0 or _ROWS.value < 0 or _TOKENS.value < 1:
    raise UserError(f"--step={_STEP.value}, --rows={_ROWS.value}, --tokens={_TOKENS.value}: "
                    "need step >= 0, rows >= 0, tokens >= 1.")
  config = settings.saved(_WORKDIR.value)
  with user_errors():
    data = data_lib.make_data(config)
    position, batch = data.position(_STEP.value), data.global_batch(_STEP.value)
  print("\n".join(describe(position, batch, _ROWS.value, _TOKENS.value)))
  newest = checkpoints.newest_step(_WORKDIR.value)
  if newest is not None and _STEP.value >= newest:
    print(f"(the run's newest checkpoint, checkpoints/{newest}, is from before step {newest}: "
          f"it has not trained step {_STEP.value} yet)")


if __name__ == "__main__":
  cli.run(main)
