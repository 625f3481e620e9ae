"""Trains the MoE transformer: `python -m launch.train --workdir=DIR --config=launch/configs/default.py`.

Any config field can be overridden with `--config.KEY=VALUE` (e.g. `--config.train_steps=50`).
Defaults to 8 simulated CPU devices unless JAX_PLATFORMS names an accelerator (or XLA_FLAGS
already sets a device count). Multi-process: on Cloud TPU VMs (and the other clusters JAX
detects: SLURM, Open MPI, Kubernetes) run the same command on every host, with
JAX_PLATFORMS=tpu (or ''), and `jax.distributed` is initialised from the environment; elsewhere
(several CPU processes on one machine over gloo) pass
`--coordinator_address=HOST:PORT --num_processes=N --process_id=I`.
"""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if os.environ["JAX_PLATFORMS"] == "cpu":
  # No TPU metadata server to ask (on a TPU VM this must stay unset: it hides the slice).
  os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
if (os.environ["JAX_PLATFORMS"] == "cpu" and
    "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", "")):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_force_host_platform_device_count=8").strip()

from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from launch import distributed, overrides, trainer  # noqa: E402

_WORKDIR = flags.DEFINE_string("workdir", None, "Where checkpoints, TensorBoard events and "
                               "alerts.jsonl go; an existing run there is resumed.",
                               required=True)
_CONFIG = config_flags.DEFINE_config_file("config", "launch/configs/default.py",
                                          "Training configuration file.")
_COORDINATOR = flags.DEFINE_string("coordinator_address", None, "HOST:PORT of process 0, for "
                                   "multi-process runs (jax.distributed.initialize).")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Processes in a multi-process run.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index in [0, "
                                   "num_processes).")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  distributed.initialize_distributed(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value,
                                     os.environ["JAX_PLATFORMS"])
  try:
    trainer.validate(_CONFIG.value)
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  trainer.train_and_evaluate(_CONFIG.value, _WORKDIR.value)


if __name__ == "__main__":
  app.run(main, flags_parser=overrides.flags_parser("config", "launch/configs/default.py"))
