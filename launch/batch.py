"""Prints the global batch of one train step of a run: where each row came from and its tokens.

  python -m launch.batch --workdir=DIR --step=N [--rows=8] [--tokens=48] [--ids]

A skipped step's alert (`nonfinite_step`, `loss_spike` in DIR/alerts.jsonl) names its step and
`data_position`; this rebuilds that step's batch from the run's data config (DIR/config.json,
written by `launch.train`), as the data pipeline served it: a pure function of the seed and
the step (the grain sources' shuffled window order, which their checkpointed iterator state
points into). Each row: its window's source file and offset (for `launch.prepare_data`'s token
files, the input file the record was made from, by its `prepare_data.json`) and its first
tokens as text (decoded with the tokenizer the files were made with), or as ids with `--ids`
or where no tokenizer is recorded. Steps are numbered from 0, as everywhere in the launcher.
"""
from absl import flags

from launch.checkpoints import store
from launch.data import batch_view, loader as data_lib
from launch.setup import cli, settings
from launch.setup.errors import UserError, user_errors

_WORKDIR = flags.DEFINE_string("workdir", None, "Workdir of a launch.train run.", required=True)
_STEP = flags.DEFINE_integer("step", None, "The train step whose batch to print (0-based, as "
                             "alerts name it).", required=True)
_ROWS = flags.DEFINE_integer("rows", 8, "Rows to print (0: all).")
_TOKENS = flags.DEFINE_integer("tokens", 48, "Leading tokens to print of each row.")
_IDS = flags.DEFINE_bool("ids", False, "Print token ids instead of text.")


def main(argv):
  del argv  # launch.setup.cli refuses arguments that are not flags
  if _STEP.value < 0 or _ROWS.value < 0 or _TOKENS.value < 1:
    raise UserError(f"--step={_STEP.value}, --rows={_ROWS.value}, --tokens={_TOKENS.value}: "
                    "need step >= 0, rows >= 0, tokens >= 1.")
  config = settings.saved(_WORKDIR.value)
  with user_errors():
    data = data_lib.make_data(config)
    position, batch = data.position(_STEP.value), data.global_batch(_STEP.value)
    shown_as = batch_view.source(config, _IDS.value)
  print("\n".join(batch_view.describe(position, batch, _ROWS.value, _TOKENS.value, shown_as)))
  newest = store.newest_step(_WORKDIR.value)
  if newest is not None and _STEP.value >= newest:
    print(f"(the run's newest checkpoint, checkpoints/{newest}, is from before step {newest}: "
          f"it has not trained step {_STEP.value} yet)")


if __name__ == "__main__":
  cli.run(main)
