"""Trains the MoE transformer: `python -m launch.train --workdir=DIR [--config=FILE]`.

Any config field can be overridden with `--config.KEY=VALUE` (e.g. `--config.train_steps=50`);
`--print_config` lists them all. Runs on the machine's TPUs or GPUs, or, where it has none, on
`config.cpu_devices` simulated CPU devices (JAX_PLATFORMS chooses otherwise: launch.platform).
Multi-process: on Cloud TPU VMs (and the other clusters JAX detects: SLURM, Open MPI,
Kubernetes) run the same command on every host, and `jax.distributed` is initialised from the
environment; elsewhere (several CPU processes on one machine over gloo) pass
`--coordinator_address=HOST:PORT --num_processes=N --process_id=I`. A mistake in the flags or
the config stops it before anything compiles, in one line (launch.cli).
"""
import os

import jax
import ml_collections
from absl import flags, logging

from launch import cli, distributed, overrides, platform, trainer
from launch.errors import UserError

_WORKDIR = flags.DEFINE_string("workdir", None, "Where checkpoints, TensorBoard events and "
                               "alerts.jsonl go; an existing run there is resumed. Required, "
                               "except with --print_config.")
_CONFIG = cli.define_config("config", "default.py", "Training configuration file.")
_PRINT_CONFIG = flags.DEFINE_boolean(
    "print_config", False, "Print the resolved config (the file with the --config.KEY=VALUE "
    "overrides), one --config.KEY=VALUE line per key, unchecked, and exit; what each key means "
    "is commented in the config file and launch/configs/default.py, which the others extend.")
_COORDINATOR = flags.DEFINE_string("coordinator_address", None, "HOST:PORT of process 0, for "
                                   "multi-process runs (jax.distributed.initialize).")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Processes in a multi-process run.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index in [0, "
                                   "num_processes).")
flags.register_multi_flags_validator(
    ["workdir", "print_config"], lambda f: f["workdir"] is not None or f["print_config"],
    "--workdir is required: the run's directory (checkpoints, events, alerts.jsonl).")


def cpu_devices(config: ml_collections.ConfigDict) -> int:
  """`config.cpu_devices`: the simulated CPU devices when jax runs on the CPU (8 without it)."""
  n = config.get("cpu_devices", 8)
  if not isinstance(n, int) or n < 1:
    raise UserError(f"config.cpu_devices={n!r} must be an integer >= 1 (the CPU devices jax "
                    "simulates where the machine has no TPU or GPU).")
  return n


def main(argv):
  del argv  # launch.cli refuses arguments that are not flags
  config = _CONFIG.value
  if _PRINT_CONFIG.value:
    print("\n".join(overrides.as_flags(config)))
    return
  if not flags.FLAGS["verbosity"].present:
    # The console is the trainer's own lines and warnings; libraries' INFO (orbax writes
    # dozens of lines a checkpoint, TensorFlow's C++ log a few at import) only with
    # --verbosity=1.
    logging.set_verbosity(logging.WARNING)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
  platforms = platform.setup(cpu_devices(config))
  distributed.initialize_distributed(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value,
                                     platforms)
  if jax.process_index() == 0:
    print(platform.describe(), flush=True)
  trainer.train_and_evaluate(config, _WORKDIR.value)


if __name__ == "__main__":
  cli.run(main)
