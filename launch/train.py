"""Trains the MoE transformer: `python -m launch.train --workdir=DIR [--config=FILE]`.

Without --config, a workdir that holds a run (its `config.json`, written by `launch.train` or
`launch.convert`) resumes with the config recorded there; a new workdir gets default.py.

Any config field can be overridden with `--config.KEY=VALUE` (e.g. `--config.train_steps=50`);
`--print_config` lists them all. Runs on the machine's TPUs or GPUs, or, where it has none, on
`config.cpu_devices` simulated CPU devices (JAX_PLATFORMS chooses otherwise: launch.setup.platform).
Multi-process: on Cloud TPU VMs (and the other clusters JAX detects: SLURM, Open MPI,
Kubernetes) run the same command on every host, and `jax.distributed` is initialised from the
environment; elsewhere (several CPU processes on one machine over gloo) pass
`--coordinator_address=HOST:PORT --num_processes=N --process_id=I`. A mistake in the flags or
the config stops it before anything compiles, in one line (launch.setup.cli).
"""
import functools
import os
import sys

import jax
import ml_collections
from absl import flags, logging

from launch.checkpoints import store
from launch.run import trainer
from launch.setup import cli, distributed, platform, settings as settings_lib

_WORKDIR = flags.DEFINE_string("workdir", None, "Where checkpoints, TensorBoard events and "
                               "alerts.jsonl go; an existing run there is resumed. Required, "
                               "except with --print_config.")
_CONFIG = cli.define_config("config", "default.py", "Training configuration file.")
_COORDINATOR = flags.DEFINE_string("coordinator_address", None, "HOST:PORT of process 0, for "
                                   "multi-process runs (jax.distributed.initialize).")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Processes in a multi-process run.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index in [0, "
                                   "num_processes).")
flags.register_multi_flags_validator(
    ["workdir", "print_config"], lambda f: f["workdir"] is not None or f["print_config"],
    "--workdir is required: the run's directory (checkpoints, events, alerts.jsonl).")


def _lost(workdir: str, timeout_s: int, count: int, processes: list[int]) -> None:
  """Another process stopped answering: one line naming it and the checkpoint to resume
  from, then exit status 1 (the others cannot go on: every step needs every process)."""
  who = f"process{'es' if len(processes) > 1 else ''} {', '.join(map(str, processes))}"
  newest = store.newest_step(workdir)
  resume = (f"the newest checkpoint is {workdir}/checkpoints/{newest} (after step "
            f"{newest - 1}): rerun every "
            "process's command to resume from it" if newest is not None else
            "no checkpoint was written yet: rerun every process's command to start again")
  sys.stderr.write(f"{cli.program()}: error: {who} of {count} stopped answering "
                   f"(no heartbeat for config.heartbeat_timeout_s={timeout_s} s); {resume}.\n")
  sys.stderr.flush()
  os._exit(cli.USER_ERROR)


def _config() -> ml_collections.ConfigDict:
  """--config's config; without one on the command line, a workdir that holds a run resumes
  with the config it recorded (its --config.KEY overrides applied), else default.py."""
  workdir = _WORKDIR.value
  if _CONFIG.explicit or not workdir or not os.path.isfile(
      os.path.join(workdir, settings_lib.RUN_CONFIG)):
    return _CONFIG.value
  print(f"config: {os.path.join(workdir, settings_lib.RUN_CONFIG)} (the run's record; "
        "--config=FILE to use another)", flush=True)
  return settings_lib.load_record(workdir, _CONFIG.overrides)


def main(argv):
  del argv  # launch.setup.cli refuses arguments that are not flags
  config = _config()
  quiet = not flags.FLAGS["verbosity"].present
  if quiet:
    # The console is the trainer's own lines and warnings; libraries' INFO (orbax writes
    # dozens of lines a checkpoint, TensorFlow's C++ log a few at import) only with
    # --verbosity=1. TensorFlow only writes the event files: its oneDNN kernels (and their
    # start-up notice) are not needed.
    logging.set_verbosity(logging.WARNING)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
    os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
  platforms = platform.setup(settings_lib.cpu_devices(config))
  if quiet and _NUM_PROCESSES.value:
    distributed.quiet_native_stdout()  # gloo's rank lines
  timeout = settings_lib.heartbeat_timeout_s(config)
  distributed.initialize_distributed(_COORDINATOR.value, _NUM_PROCESSES.value,
                                     _PROCESS_ID.value, platforms, heartbeat_timeout_s=timeout)
  cli.set_process(jax.process_index(), jax.process_count())
  processes = jax.process_count()
  watchdog = distributed.watch(
      timeout, functools.partial(_lost, os.path.abspath(_WORKDIR.value), timeout, processes))
  print(("" if processes == 1 else f"process {jax.process_index()}/{processes}: ") +
        platform.describe(), flush=True)
  try:
    trainer.train_and_evaluate(
        settings_lib.build(config, jax.device_count(), platform=jax.devices()[0].platform),
        _WORKDIR.value)
  except jax.errors.JaxRuntimeError:
    if watchdog:  # a peer that died fails the collective before its heartbeat is missed
      watchdog.settle()
    raise
  finally:
    if watchdog:
      watchdog.stop()


if __name__ == "__main__":
  cli.run(main)
