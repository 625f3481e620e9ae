"""`launch.setup.distributed`: when `launch.train` starts `jax.distributed`, and with what."""
import signal
import subprocess
import sys
import time

import pytest
from absl import app

from launch.setup import distributed, errors
from launch.setup.distributed import Watchdog, initialize_distributed, jax_heartbeat_timeout_s
from tests.helpers import ROOT


class _Recorder:
  """Stands in for `jax.distributed.initialize`: records its calls (the heartbeat timeout
  apart), may raise like it."""

  def __init__(self, error: Exception | None = None):
    self.calls, self.error, self.timeouts = [], error, []

  def __call__(self, *args, heartbeat_timeout_seconds):
    self.calls.append(args)
    self.timeouts.append(heartbeat_timeout_seconds)
    if self.error is not None:
      raise self.error


def test_flags_initialise_explicitly_on_any_platform():
  init = _Recorder()
  initialize_distributed("10.0.0.1:1234", 4, 3, "cpu", heartbeat_timeout_s=7, initialize=init)
  assert init.calls == [("10.0.0.1:1234", 4, 3)]
  assert init.timeouts == [jax_heartbeat_timeout_s(7)]  # the watchdog decides first


@pytest.mark.parametrize("platforms", ["tpu", "", "cuda"])
def test_accelerator_runs_auto_detect_the_cluster(platforms):
  """On a Cloud TPU VM (or a SLURM/MPI/Kubernetes cluster), no flags: JAX reads the slice."""
  init = _Recorder()
  initialize_distributed(None, None, None, platforms, initialize=init)
  assert init.calls == [()]


@pytest.mark.parametrize("error", [
    ValueError("coordinator_address should be defined."),  # jax detected no cluster
    # A TPU host without a metadata server: jax's Cloud TPU detection asks it first (requests).
    ConnectionError("HTTPConnectionPool(host='metadata.google.internal', port=80): Max "
                    "retries exceeded\n(a second line)"),
])
def test_no_cluster_found_stays_one_process_in_one_line(error, monkeypatch, capsys):
  for name in distributed._CLUSTER_VARIABLES:
    monkeypatch.delenv(name, raising=False)
  init = _Recorder(error)
  initialize_distributed(None, None, None, "tpu", initialize=init)  # does not raise
  assert init.calls == [()]
  out = capsys.readouterr().out
  assert out.count("\n") == 1 and "running as one process" in out, out
  assert type(error).__name__ in out, out


def test_a_cluster_whose_detection_fails_names_the_flags(monkeypatch):
  monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "host-0,host-1")
  init = _Recorder(ConnectionError("metadata.google.internal unreachable"))
  with pytest.raises(errors.UserError, match=r"variables \(TPU_WORKER_HOSTNAMES\).*pass "
                     r"--coordinator_address=HOST:PORT --num_processes=N --process_id=I"):
    initialize_distributed(None, None, None, "tpu", initialize=init)


def test_cpu_without_flags_does_not_initialise():
  init = _Recorder()
  initialize_distributed(None, None, None, "cpu", initialize=init)
  assert init.calls == []


@pytest.mark.parametrize("flags,message", [
    (("h:1", None, 0), "need --coordinator_address, --num_processes and --process_id together"),
    (("h:1", 2, 2), r"--process_id=2 must be in \[0, 2\)"),
])
def test_partial_or_bad_flags_are_usage_errors(flags, message):
  init = _Recorder()
  with pytest.raises(app.UsageError, match=message):
    initialize_distributed(*flags, "cpu", initialize=init)
  assert init.calls == []


class _Store:
  """Stands in for the coordination service's key-value store; `down` makes it fail."""

  def __init__(self):
    self.values, self.down = {}, False

  def key_value_set(self, key, value, allow_overwrite=False):
    if self.down:
      raise RuntimeError("UNAVAILABLE")
    self.values[key] = value

  def key_value_try_get(self, key):
    if self.down:
      raise RuntimeError("UNAVAILABLE")
    if key not in self.values:
      raise KeyError(key)
    return self.values[key]


def test_a_process_whose_heartbeat_stops_is_lost_after_the_timeout():
  """Processes 0 and 2 of three keep publishing, process 1 stops at t=3: process 0's watchdog
  reports it once its counter has not moved for 5 s, not before."""
  store = _Store()
  dogs = [Watchdog(store, p, 3, timeout_s=5.0, on_lost=None) for p in range(3)]
  lost = {}
  # The watchdogs stamp their start with time.monotonic(): the test's clock starts there too
  # (a fixed origin fails on a host up for less than it).
  origin = time.monotonic()
  for t in range(12):
    for p, dog in enumerate(dogs):
      if p == 1 and t >= 3:
        continue
      found = dog.check(now=origin + t)
      if found:
        lost.setdefault(p, (t, found))
  # Process 1's last beat (at t=2) was read by process 2 at t=2 and by process 0, which checks
  # before process 1 publishes, at t=3: each reports it more than 5 s later.
  assert lost == {0: (9, [1]), 2: (8, [1])}


def test_a_lost_coordinator_is_process_0():
  store = _Store()
  dog = Watchdog(store, 1, 2, timeout_s=5.0, on_lost=None)
  assert dog.check(now=0.0) == []
  store.down = True
  assert dog.check(now=4.0) == [] and dog.check(now=5.5) == [0]


def test_jax_waits_longer_than_the_watchdog():
  assert jax_heartbeat_timeout_s(5) > 2 * 5 and jax_heartbeat_timeout_s(100) > 2 * 100


_ABORTING_PROCESS = """
import ctypes, itertools, os, sys, threading, time
from launch.setup.distributed import Watchdog

class Store:  # the peer, process 1, beats ({beats}) or has stopped
  beats = itertools.count()
  def key_value_set(self, key, value, allow_overwrite=False): pass
  def key_value_try_get(self, key): return str(next(self.beats) if {beats} else 0)

def lost(processes):
  sys.stderr.write(f"lost {{processes}}\\n"); sys.stderr.flush(); os._exit(1)

watchdog = Watchdog(Store(), 0, 2, timeout_s=1.0, on_lost=lost, period_s=0.1).start()
watchdog.catch_aborts()
if {stopped}:  # the run's work is done; the peer stays silent past the timeout: no verdict
  watchdog.stop()
  time.sleep(2.5)
# A thread outside Python's locks aborts, as gloo's does (ctypes releases the GIL for the call).
threading.Thread(target=ctypes.CDLL(None).abort, name="native").start()
time.sleep(30)
"""


def _aborting_process(beats: bool, stopped: bool = False) -> tuple[subprocess.CompletedProcess,
                                                                    float]:
  """The child above, and the seconds it took."""
  start = time.monotonic()
  child = subprocess.run(
      [sys.executable, "-c", _ABORTING_PROCESS.format(beats=beats, stopped=stopped)],
      cwd=ROOT, capture_output=True, text=True, timeout=60)
  return child, time.monotonic() - start


@pytest.mark.parametrize("beats", [False, True])
def test_an_abort_waits_for_the_watchdogs_verdict(beats):
  """A native thread that aborts (gloo's, after a peer's connection closed) does not end the
  process before the watchdog: with process 1 silent, the watchdog's one line and its exit
  status 1 end it; with process 1 still beating, the abort goes on (SIGABRT) after that wait
  (about a second here, not the child's 30 s sleep), with the threads' tracebacks."""
  child, took = _aborting_process(beats)
  if beats:
    assert child.returncode == -signal.SIGABRT, (child.returncode, child.stderr[-2000:])
    assert "most recent call first" in child.stderr and "lost" not in child.stderr
  else:
    assert child.returncode == 1 and child.stderr.splitlines()[-1] == "lost [1]", (
        child.returncode, child.stderr[-2000:])
  assert took < 20, took


def test_a_stopped_watchdog_judges_nothing_and_leaves_aborts_alone():
  """Once the run's work is done (`stop`), a peer silent for more than twice the timeout (one
  that finished and exited) is not lost, and an abort (gloo's teardown) then is SIGABRT at
  once: no verdict, no tracebacks from the handler, which runs Python an exiting interpreter
  no longer runs."""
  child, _ = _aborting_process(beats=False, stopped=True)
  assert child.returncode == -signal.SIGABRT, (child.returncode, child.stderr[-2000:])
  assert "lost" not in child.stderr and "most recent call first" not in child.stderr


@pytest.mark.parametrize("environ,hosts", [
    # What a lent v5e chip's runtime sets: one host, however many variables say so.
    (dict(TPU_WORKER_HOSTNAMES="localhost", TPU_HOST_BOUNDS="1,1,1", TPU_WORKER_ID="0"), 1),
    (dict(TPU_HOST_BOUNDS="1,1,1"), 1),
    (dict(TPU_WORKER_HOSTNAMES="t1v-0,t1v-1,t1v-2,t1v-3"), 4),
    (dict(TPU_WORKER_HOSTNAMES="localhost", TPU_HOST_BOUNDS="2,2,1"), 4),
    (dict(TPU_PROCESS_ADDRESSES="10.0.0.1:8476,10.0.0.2:8476"), 2),
    (dict(TPU_WORKER_HOSTNAMES="localhost", MEGASCALE_NUM_SLICES="2"), 2),
    (dict(SLURM_JOB_ID="77", SLURM_NTASKS="8"), 8),
    (dict(SLURM_JOB_ID="77", SLURM_NTASKS="1"), 1),
    (dict(OMPI_COMM_WORLD_SIZE="16"), 16),
    # No count: jax's detection decides.
    (dict(SLURM_JOB_ID="77"), None),
    (dict(MEGASCALE_COORDINATOR_ADDRESS="10.0.0.1"), None),
    (dict(OMPI_MCA_orte_hnp_uri="123.0;tcp://10.0.0.1:5000"), None),
    ({}, None),
])
def test_hosts_are_read_from_what_the_variables_say(environ, hosts):
  assert distributed.hosts_named(environ) == hosts


def test_a_single_host_runtime_runs_as_one_process_without_initialising(monkeypatch, capsys):
  """A lent chip's runtime names one host (and the host opens no sockets): jax.distributed is
  not started, and one line says why."""
  for name in distributed._CLUSTER_VARIABLES:
    monkeypatch.delenv(name, raising=False)
  monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "localhost")
  monkeypatch.setenv("TPU_HOST_BOUNDS", "1,1,1")
  init = _Recorder(ConnectionError("metadata.google.internal unreachable"))
  initialize_distributed(None, None, None, "", initialize=init)
  assert init.calls == []
  out = capsys.readouterr().out
  assert out.count("\n") == 1 and "runtime names one host" in out, out
  assert "TPU_WORKER_HOSTNAMES" in out and "running as one process" in out, out


@pytest.mark.parametrize("name,value", [
    ("TPU_WORKER_HOSTNAMES", "host-0,host-1"), ("TPU_HOST_BOUNDS", "2,1,1"),
    ("TPU_PROCESS_ADDRESSES", "a:1,b:1"), ("MEGASCALE_COORDINATOR_ADDRESS", "10.0.0.1"),
    ("MEGASCALE_NUM_SLICES", "2"), ("SLURM_JOB_ID", "77"), ("SLURM_NTASKS", "4"),
    ("OMPI_COMM_WORLD_SIZE", "4"), ("OMPI_MCA_orte_hnp_uri", "1.0;tcp://10.0.0.1:5000"),
])
def test_each_multi_host_launchers_variable_makes_a_failed_detection_an_error(
    name, value, monkeypatch):
  """Every launcher's variable, listed here rather than read from the product's tuple: a
  cluster of any of them whose detection fails is never run as one process."""
  for other in distributed._CLUSTER_VARIABLES:
    monkeypatch.delenv(other, raising=False)
  monkeypatch.setenv(name, value)
  init = _Recorder(ValueError("coordinator_address should be defined."))
  with pytest.raises(errors.UserError, match=rf"variables \({name}\)"):
    initialize_distributed(None, None, None, "tpu", initialize=init)
  assert init.calls == [()]
