"""`launch.training.checkpoints`: an unreadable newest checkpoint costs one warning line, and
nothing of its failed reads reaches the console later, however often it happens."""
import gc
import glob
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest

from launch.training import checkpoints as checkpoints_lib


def _state(seed: int) -> dict:
  """A train-state-like tree of 48 arrays (many reads in flight when one fails)."""
  rng = np.random.default_rng(seed)
  return {f"layer_{i}": {"w": jnp.asarray(rng.normal(size=(64, 128)), jnp.float32),
                         "b": jnp.asarray(rng.normal(size=(128,)), jnp.float32)}
          for i in range(24)}


def _corrupt_newest(directory: str) -> None:
  """Truncates the newest checkpoint's largest array file, as a crash mid-copy would."""
  newest = max(int(d) for d in os.listdir(directory) if d.isdigit())
  files = [f for f in glob.glob(os.path.join(directory, str(newest), "state", "**"),
                                recursive=True) if os.path.isfile(f)]
  largest = max(files, key=os.path.getsize)
  with open(largest, "r+b") as f:
    f.truncate(100)


def test_an_unreadable_checkpoint_is_one_warning_ten_times_in_a_row(tmp_path):
  unraisable = []
  previous = sys.unraisablehook
  sys.unraisablehook = unraisable.append  # what would reach the console, from here on
  try:
    for round_ in range(10):
      workdir = str(tmp_path / f"run{round_}")
      saver = checkpoints_lib.Checkpoints(workdir, keep=3, every=1)
      for step in (1, 2):
        saver.save(step, _state(step), {"source": "stdlib"}, {}, {})
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
    # The hook the restores installed drops their late callbacks and passes the rest on.
    assert getattr(sys.unraisablehook, "drops_late_reads", False)
  finally:
    dropping, sys.unraisablehook = sys.unraisablehook, previous
  assert unraisable == [], [str(u.exc_value) for u in unraisable]
  # Any other unraisable exception still reaches the hook it wrapped.
  other = type("Unraisable", (), {"exc_value": RuntimeError("a bug"), "object": None})()
  dropping(other)
  assert unraisable == [other]
