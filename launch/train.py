"""Trains the MoE transformer: `python -m launch.train --workdir=DIR --config=launch/configs/default.py`.

Any config field can be overridden with `--config.KEY=VALUE` (e.g. `--config.train_steps=50`).
Defaults to 8 simulated CPU devices unless JAX_PLATFORMS names an accelerator.
"""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
if os.environ["JAX_PLATFORMS"] == "cpu":
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_force_host_platform_device_count=8").strip()

from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from launch import trainer  # noqa: E402

_WORKDIR = flags.DEFINE_string("workdir", None, "Where checkpoints, TensorBoard events and "
                               "alerts.jsonl go; an existing run there is resumed.",
                               required=True)
_CONFIG = config_flags.DEFINE_config_file("config", "launch/configs/default.py",
                                          "Training configuration file.")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  try:
    trainer.validate(_CONFIG.value)
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  trainer.train_and_evaluate(_CONFIG.value, _WORKDIR.value)


if __name__ == "__main__":
  app.run(main)
