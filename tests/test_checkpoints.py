"""`launch.checkpoints.store`: the train state and a mapping of stateful parts round-trip; an
unreadable newest checkpoint costs one warning line, and nothing of its failed reads reaches
the console later, however often it happens."""
import gc
import glob
import logging
import os
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import absltest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from launch.checkpoints import store as checkpoints_lib
from launch.setup.errors import UserError


def _state(seed: int) -> dict:
  """A train-state-like tree of 48 arrays, each sharded over the 8 devices: hundreds of shard
  reads in flight when one fails, as in a trainer's restore."""
  rng = np.random.default_rng(seed)
  rows = NamedSharding(Mesh(np.array(jax.devices()), ("x",)), PartitionSpec("x"))
  return {f"layer_{i}": {"w": jax.device_put(jnp.asarray(rng.normal(size=(64, 128)),
                                                         jnp.float32), rows)}
          for i in range(48)}


def _corrupt_newest(directory: str) -> None:
  """Truncates the newest checkpoint's largest array file to half, as a crash mid-copy
  would: the reads of its first half succeed, the others fail."""
  newest = max(int(d) for d in os.listdir(directory) if d.isdigit())
  files = [f for f in glob.glob(os.path.join(directory, str(newest), "state", "**"),
                                recursive=True) if os.path.isfile(f)]
  largest = max(files, key=os.path.getsize)
  with open(largest, "r+b") as f:
    f.truncate(os.path.getsize(largest) // 2)


class _Part:
  """A stateful part of a run: its state is a dict."""

  def __init__(self, state: dict):
    self.state = state

  def state_dict(self) -> dict:
    return dict(self.state)

  def load_state_dict(self, state: dict) -> None:
    self.state = dict(state)


def test_every_part_of_the_mapping_travels_and_a_missing_part_keeps_its_state(tmp_path):
  """The checkpoint saves and restores a {name: stateful} mapping: a part is one entry. A
  part the checkpoint lacks (one added since it was written) keeps its state; a part saved
  empty (an autopilot that was off) leaves the live one alone; the train state has its own
  item, never a part's name."""
  saver = checkpoints_lib.Checkpoints(str(tmp_path), keep=2, every=1)
  saver.save(1, _state(1), {"data": _Part({"source": "stdlib", "step": 1}),
                            "alerts": _Part({"last_sent": {"fallback_ran": 0}}),
                            "autopilot": _Part({})})
  with pytest.raises(ValueError, match="'state' names the train state"):
    saver.save(2, _state(2), {"state": _Part({})})
  saver.wait()
  abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
                          _state(0))
  restored = saver.restore(abstract)
  saver.close()
  assert restored.step == 1
  assert restored.parts == {"data": {"source": "stdlib", "step": 1},
                            "alerts": {"last_sent": {"fallback_ran": 0}}, "autopilot": {}}
  jax.tree.map(np.testing.assert_array_equal, restored.state, _state(1))
  live = {"data": _Part({}), "alerts": _Part({}), "autopilot": _Part({"compiled": 2}),
          "added_since": _Part({"kept": True})}
  restored.apply(live)
  assert {name: part.state for name, part in live.items()} == {
      "data": {"source": "stdlib", "step": 1}, "alerts": {"last_sent": {"fallback_ran": 0}},
      "autopilot": {"compiled": 2}, "added_since": {"kept": True}}


def _restore_corrupted(tmp_path, rounds: int) -> None:
  """`rounds` times: two checkpoints, the newer corrupted, restored from the older with one
  warning; then time for the failed reads' stragglers to finish."""
  for round_ in range(rounds):
    workdir = str(tmp_path / f"run{round_}")
    saver = checkpoints_lib.Checkpoints(workdir, keep=3, every=1)
    for step in (1, 2):
      saver.save(step, _state(step), {"data": _Part({"source": "stdlib"})})
    saver.wait()
    saver.close()
    _corrupt_newest(os.path.join(workdir, "checkpoints"))
    reader = checkpoints_lib.Checkpoints(workdir, keep=3, every=1)
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                                           sharding=a.sharding), _state(0))
    with absltest.mock.patch.object(checkpoints_lib.logging, "warning") as warning:
      restored = reader.restore(abstract)
    reader.close()
    assert restored.step == 1 and warning.call_count == 1, (round_, warning.call_args_list)
    jax.tree.map(np.testing.assert_array_equal, restored.state, _state(1))
    assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["1", "corrupt-2"]
  time.sleep(2)  # the failed restores' last reads finish, their callbacks run
  gc.collect()


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="Python 3.12's asyncio (jax 0.12) "
                    "leaves no late reads in this scenario: 0 in 12 rounds")
def test_late_reads_happen_in_this_scenario(tmp_path, monkeypatch):
  """The control: without the trainer's filter, the failed reads' late callbacks do reach the
  unraisable hook (dozens a restore on Python 3.11, when the reads outlive the failed restore:
  a matter of timing, so up to 4 rounds), so the test below has something to drop."""
  monkeypatch.setattr(checkpoints_lib, "_drop_late_reads", lambda folder: None)
  unraisable = []
  monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
  for round_ in range(4):
    _restore_corrupted(tmp_path / str(round_), rounds=1)
    if unraisable:
      break
  if not unraisable:
    pytest.skip("no late read reached the hook in 4 rounds: they come only when a failed "
                "restore's reads outlive it, which this machine's timing decides (the fresh-clone "
                "CI run saw none; earlier runs here saw dozens)")
  assert all(checkpoints_lib._late_read(u) for u in unraisable)


def test_an_unreadable_checkpoint_is_one_warning_ten_times_in_a_row(tmp_path):
  unraisable = []
  previous = sys.unraisablehook
  sys.unraisablehook = unraisable.append  # what would reach the console, from here on
  try:
    _restore_corrupted(tmp_path, rounds=10)
    # The hook the restores installed drops their late callbacks and passes the rest on.
    assert getattr(sys.unraisablehook, "drops_late_reads", False)
  finally:
    dropping, sys.unraisablehook = sys.unraisablehook, previous
  assert unraisable == [], [str(u.exc_value) for u in unraisable]
  # Any other unraisable exception still reaches the hook it wrapped.
  other = type("Unraisable", (), {"exc_value": RuntimeError("a bug"), "object": None})()
  dropping(other)
  assert unraisable == [other]


def test_asyncio_reports_of_late_reads_are_dropped_and_no_others(tmp_path):
  """asyncio's 'never retrieved' report of a read error in a restored checkpoints folder is
  dropped; the same report about anything else, and other asyncio errors, pass."""
  folder = str(tmp_path / "checkpoints")
  checkpoints_lib._drop_late_reads(folder)
  def passes(message: str) -> bool:
    record = logging.LogRecord("asyncio", logging.ERROR, __file__, 1, message, None, None)
    return logging.getLogger("asyncio").filter(record)
  late = ("Future exception was never retrieved\nfuture: <Future finished exception=ValueError("
          f"'OUT_OF_RANGE: Error reading \"params\" at local file \"{folder}/8/state/\"')>")
  assert not passes(late)
  assert not passes("Task was destroyed but it is pending!")
  assert passes(late.replace(folder, str(tmp_path / "elsewhere")))
  assert passes("Exception in callback Handle._run()")


def test_a_failed_saves_late_writes_are_removed_too(tmp_path):
  """orbax raises at a save's first failed write while its other writes go on: one that
  creates its file (and folders) after the failed save's temporary folder was removed must
  not leave that folder behind (a rerun would find it beside the intact checkpoints)."""
  saver = checkpoints_lib.Checkpoints(str(tmp_path), keep=3, every=1)
  partial = tmp_path / "checkpoints" / "8.orbax-checkpoint-tmp"

  def late_write():
    time.sleep(0.1)  # after the first removal, as a write still in flight lands
    os.makedirs(partial / "d", exist_ok=True)
    (partial / "d" / "late").write_bytes(b"\0")

  def failing_save():
    os.makedirs(partial / "d")
    threading.Thread(target=late_write).start()
    raise OSError(28, "No space left on device")
  try:
    with pytest.raises(UserError, match=r"failed \(.*No space left on device.*\); none was "
                                        r"written"):
      saver._guarded(failing_save)
  finally:
    saver.close()
  assert os.listdir(tmp_path / "checkpoints") == []
