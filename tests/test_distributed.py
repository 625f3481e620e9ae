"""`launch.distributed`: when `launch.train` starts `jax.distributed`, and with what."""
import pytest
from absl import app

from launch.distributed import initialize_distributed


class _Recorder:
  """Stands in for `jax.distributed.initialize`: records its calls, may raise like it."""

  def __init__(self, error: Exception | None = None):
    self.calls, self.error = [], error

  def __call__(self, *args):
    self.calls.append(args)
    if self.error is not None:
      raise self.error


def test_flags_initialise_explicitly_on_any_platform():
  init = _Recorder()
  initialize_distributed("10.0.0.1:1234", 4, 3, "cpu", init)
  assert init.calls == [("10.0.0.1:1234", 4, 3)]


@pytest.mark.parametrize("platforms", ["tpu", "", "cuda"])
def test_accelerator_runs_auto_detect_the_cluster(platforms):
  """On a Cloud TPU VM (or a SLURM/MPI/Kubernetes cluster), no flags: JAX reads the slice."""
  init = _Recorder()
  initialize_distributed(None, None, None, platforms, init)
  assert init.calls == [()]


def test_no_cluster_found_stays_one_process():
  init = _Recorder(ValueError("coordinator_address should be defined."))
  initialize_distributed(None, None, None, "tpu", init)  # does not raise
  assert init.calls == [()]


def test_cpu_without_flags_does_not_initialise():
  init = _Recorder()
  initialize_distributed(None, None, None, "cpu", init)
  assert init.calls == []


@pytest.mark.parametrize("flags,message", [
    (("h:1", None, 0), "need --coordinator_address, --num_processes and --process_id together"),
    (("h:1", 2, 2), r"--process_id=2 must be in \[0, 2\)"),
])
def test_partial_or_bad_flags_are_usage_errors(flags, message):
  init = _Recorder()
  with pytest.raises(app.UsageError, match=message):
    initialize_distributed(*flags, "cpu", init)
  assert init.calls == []
