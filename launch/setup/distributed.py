"""Starting `jax.distributed` for `launch.train`: from flags, or from the cluster environment;
and ending the run in one line when a process is lost.

A process that the others can no longer reach (killed, its host lost) would leave them waiting
in their next collective until jax's coordination service notices its missing heartbeats and
aborts every process with a native stack dump. `Watchdog` decides first: each process
publishes a counter in the service's key-value store every second, and a process whose
counter has not moved for `heartbeat_timeout_s` (or a service that stops answering: process 0
holds it) is lost; the watchdog then calls `on_lost`, which ends the process with one line.
jax's own heartbeat timeout is set well beyond it. A collective that fails first (gloo sees
the closed connection at once) waits for the watchdog's verdict (`Watchdog.settle`); so does an
abort from a native thread (`Watchdog.catch_aborts`).
"""
from __future__ import annotations

import ctypes
import faulthandler
import math
import os
import signal
import sys
import threading
import time
from typing import Callable

import jax
from absl import app
from jax._src import distributed as jax_distributed

from launch.setup import errors

_KEY = "moe_hk/heartbeat/{}"
_SIGNAL_HANDLER = ctypes.CFUNCTYPE(None, ctypes.c_int)


def jax_heartbeat_timeout_s(heartbeat_timeout_s: int) -> int:
  """jax's coordination-service timeout for a run whose watchdog waits `heartbeat_timeout_s`:
  far enough beyond it (the service may act after half its timeout) that the watchdog's one
  line comes first."""
  return 3 * heartbeat_timeout_s + 10


def initialize_distributed(coordinator: str | None, num_processes: int | None,
                           process_id: int | None, platforms: str, *,
                           heartbeat_timeout_s: int = 100,
                           initialize: Callable[..., None] = jax.distributed.initialize) -> None:
  """Starts `jax.distributed`: from the three flags when given (all or none); else, unless
  the run is on CPU (`platforms` = JAX_PLATFORMS), from the environment JAX detects (Cloud
  TPU VM metadata, SLURM, ...), staying a single process where it detects none."""
  given = [name for name, value in (("coordinator_address", coordinator),
                                    ("num_processes", num_processes),
                                    ("process_id", process_id)) if value is not None]
  if given and len(given) != 3:
    raise app.UsageError("multi-process runs need --coordinator_address, --num_processes and "
                         f"--process_id together; got only {', '.join('--' + g for g in given)}.")
  timeout = dict(heartbeat_timeout_seconds=jax_heartbeat_timeout_s(heartbeat_timeout_s))
  if given:
    if not 0 <= process_id < num_processes:
      raise app.UsageError(f"--process_id={process_id} must be in [0, {num_processes}).")
    initialize(coordinator, num_processes, process_id, **timeout)
  elif platforms != "cpu":
    hosts = hosts_named(os.environ)
    if hosts == 1:
      # A single-host runtime (a lent chip, a one-host slice or GKE pod): no coordinator to
      # reach, and such a host may open no sockets at all.
      print("jax.distributed: this host's runtime names one host "
            f"({', '.join(cluster_variables(os.environ))}): running as one process.",
            flush=True)
      return
    try:
      initialize(**timeout)
    except Exception as e:  # noqa: BLE001  (detection may fail any way: see `_detection_failed`)
      _detection_failed(e, cluster_variables(os.environ))


# Variables a multi-host launcher sets (Cloud TPU on GKE, multislice, SLURM, Open MPI): with one
# of them saying several hosts, a failed detection is a failed multi-host launch, not a lone host.
_CLUSTER_VARIABLES = ("TPU_WORKER_HOSTNAMES", "TPU_HOST_BOUNDS", "TPU_PROCESS_ADDRESSES",
                      "MEGASCALE_COORDINATOR_ADDRESS", "MEGASCALE_NUM_SLICES", "SLURM_JOB_ID",
                      "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "OMPI_MCA_orte_hnp_uri")


def cluster_variables(environ) -> list[str]:
  """The names of `_CLUSTER_VARIABLES` set in `environ`."""
  return [name for name in _CLUSTER_VARIABLES if environ.get(name)]


def _count(name: str, value: str) -> int | None:
  """How many hosts (or processes) one variable's value names; None where it names no count."""
  if name in ("TPU_WORKER_HOSTNAMES", "TPU_PROCESS_ADDRESSES"):
    return len([h for h in value.split(",") if h.strip()])
  if name == "TPU_HOST_BOUNDS":  # hosts along each axis of the slice, e.g. "1,1,1" or "2,2,1"
    try:
      return math.prod(int(b) for b in value.split(","))
    except ValueError:
      return None
  if name in ("MEGASCALE_NUM_SLICES", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):
    return int(value) if value.strip().isdigit() else None
  return None


def hosts_named(environ) -> int | None:
  """The number of hosts (processes) the cluster variables in `environ` say the run has: the
  largest count any of them gives (a single-host TPU runtime sets `TPU_WORKER_HOSTNAMES=
  localhost` and `TPU_HOST_BOUNDS=1,1,1`: one host, whatever other variables it sets); None
  when none gives a count (no variable, or only ones like SLURM_JOB_ID or a coordinator's
  address), which leaves the question to jax's detection."""
  counts = [_count(name, environ[name]) for name in cluster_variables(environ)]
  known = [c for c in counts if c is not None]
  return max(known) if known else None


def _detection_failed(error: Exception, variables: list[str]) -> None:
  """jax found no cluster, or its detection itself failed: on a host that no launcher set
  variables for, one process and one line saying so; otherwise one line naming the flags.

  jax raises ValueError when no cluster is detected, but its Cloud TPU detection asks the
  VM's metadata server first, and a TPU host without one (a lent chip, a container) gets the
  HTTP client's connection error instead, as any other host would that cannot reach it."""
  cause = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
  if variables:
    raise errors.UserError(
        f"this host has a cluster launcher's variables ({', '.join(variables)}) but jax could "
        f"not detect the cluster from them ({cause[:200]}); pass --coordinator_address=HOST:PORT "
        "--num_processes=N --process_id=I on every host.")
  print("jax.distributed: no cluster environment on this host "
        f"({cause[:120]}): running as one process.", flush=True)


class Watchdog:
  """Ends this process, through `on_lost(processes)`, when another process of the run stops
  publishing its heartbeat for `timeout_s` (the module docstring). `store` is the
  coordination service's client (`key_value_set`, `key_value_try_get`)."""

  def __init__(self, store, process: int, processes: int, timeout_s: float,
               on_lost: Callable[[list[int]], None], period_s: float = 1.0):
    self.store, self.process, self.processes = store, process, processes
    self.timeout_s, self.on_lost, self.period_s = timeout_s, on_lost, period_s
    now = time.monotonic()
    self._seen = {p: (None, now) for p in range(processes) if p != process}
    self._beat = 0
    self._answered = now  # when the service last answered
    self._stopped = threading.Event()
    self._libc, self._on_abort, self._previous_abort = None, None, None

  def start(self) -> "Watchdog":
    threading.Thread(target=self._run, name="moe-hk-watchdog", daemon=True).start()
    return self

  def settle(self) -> None:
    """Waits until the watchdog could have seen a lost process (it then ends this one): for
    the main thread to call when a collective failed, which a peer that died makes happen
    before its heartbeat is missed. Returns when every process still answers."""
    time.sleep(self.timeout_s + 2 * self.period_s)

  def catch_aborts(self) -> "Watchdog":
    """Makes SIGABRT wait for the watchdog's verdict too. gloo's TCP thread can throw past
    every caller when a peer's connection closes under it (`terminate`, then `abort`, about
    0.1 s after the peer died and long before its heartbeat is missed). The handler runs in
    the aborting thread, which holds no Python lock: it settles (the watchdog then ends the
    process with its one line); with every process still answering, it prints the threads'
    tracebacks (faulthandler's, which it replaces) and the abort goes on. A C-level handler
    through ctypes: a Python one (`signal.signal`) would only run after `abort` has ended the
    process."""
    libc = ctypes.CDLL(None)
    libc.signal.restype = ctypes.c_void_p
    libc.signal.argtypes = (ctypes.c_int, ctypes.c_void_p)

    def on_abort(signum: int) -> None:
      libc.signal(signum, None)  # SIG_DFL: a second abort, or this one going on, ends it
      self.settle()
      faulthandler.dump_traceback(all_threads=True)

    self._libc, self._on_abort = libc, _SIGNAL_HANDLER(on_abort)  # alive until `stop`
    self._previous_abort = libc.signal(signal.SIGABRT,
                                       ctypes.cast(self._on_abort, ctypes.c_void_p))
    return self

  def stop(self) -> None:
    """Ends the watch once the run's work is done (a peer that finished and exited is not
    lost) and gives SIGABRT back to its previous handler: `catch_aborts`' handler runs Python,
    which an interpreter that is exiting no longer runs (an abort from gloo's teardown then
    crashed the process instead of aborting it)."""
    self._stopped.set()
    if self._on_abort is not None:
      self._libc.signal(signal.SIGABRT, self._previous_abort)
      self._on_abort = None

  def check(self, now: float) -> list[int]:
    """Publishes this process's heartbeat and reads the others'; returns the processes lost
    by `now` (process 0 when the service, which process 0 holds, stopped answering)."""
    try:
      self._beat += 1
      self.store.key_value_set(_KEY.format(self.process), str(self._beat), allow_overwrite=True)
      for p, (value, since) in self._seen.items():
        try:
          current = self.store.key_value_try_get(_KEY.format(p))
        except Exception:  # noqa: BLE001  (not published yet: the process is starting)
          current = value
        if current != value:
          self._seen[p] = (current, now)
      self._answered = now
    except Exception:  # noqa: BLE001  (the service itself is gone)
      return [0] if now - self._answered > self.timeout_s else []
    return [p for p, (_, since) in self._seen.items() if now - since > self.timeout_s]

  def _run(self) -> None:
    while not self._stopped.wait(self.period_s):
      lost = self.check(time.monotonic())
      if lost and not self._stopped.is_set():
        self.on_lost(lost)
        return


def watch(timeout_s: float, on_lost: Callable[[list[int]], None]) -> Watchdog | None:
  """Starts this process's `Watchdog`, aborts caught, when the run has several processes
  (None otherwise).
  The service's client is jax's own (`jax._src.distributed`: jax exposes no key-value API)."""
  if jax.process_count() == 1:
    return None
  client = jax_distributed.global_state.client  # noqa: SLF001
  return Watchdog(client, jax.process_index(), jax.process_count(), timeout_s,
                  on_lost).start().catch_aborts()


def quiet_native_stdout() -> None:
  """Sends what native libraries print to the C-level stdout (gloo's `[Gloo] Rank ...` lines,
  a dozen a process) to /dev/null; Python's own `print`s keep the console."""
  sys.stdout.flush()
  console = os.dup(1)
  with open(os.devnull, "w") as devnull:
    os.dup2(devnull.fileno(), 1)
  sys.stdout = os.fdopen(console, "w", buffering=1)
