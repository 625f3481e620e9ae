"""Every switch of the launcher's config trains, or is refused in one line before anything is
traced: each boolean of the tiny config flipped and every value of every checked choice key.

The keys are found, not listed: the booleans by walking the config, the choice keys by asking
the settings about a value no key takes (their one line names the valid values: "must be one
of 'a', 'b'"), so a key added later is swept without editing this file. The changes are
packed into as few runs as the settings accept together (each run compiles one program: the
sweep trains a handful of tiny models, not one per value); a value the platform lacks must be
refused in one line naming the key, and a pair of values that cannot combine in one line
naming both.
"""
import re

import jax
import ml_collections
import numpy as np
import pytest

from launch.hf.importing import configured
from launch.run import trainer
from launch.setup.errors import UserError
from tests.helpers import settings_of, tiny_config

PROBE = "__sweep_probe__"
# Keys the sweep leaves as they are: the mesh's axis name (a name, not a choice) and where
# the files are (set with the file sources below).
FREE_FORM = {"moe.expert_axis", "data.pattern"}


def walk(config: ml_collections.ConfigDict, prefix: str = ""):
  """(dotted key, value) of every leaf of `config`."""
  for key, value in config.items():
    if isinstance(value, ml_collections.ConfigDict):
      yield from walk(value, f"{prefix}{key}.")
    else:
      yield f"{prefix}{key}", value


def build(config: ml_collections.ConfigDict):
  """The settings for this machine's devices and platform (its refusals included)."""
  return settings_of(config, platform=jax.devices()[0].platform)


def choice_values(base: ml_collections.ConfigDict, key: str) -> tuple[str, ...] | None:
  """The values the settings allow for string key `key` (from their one-line refusal of a
  value no key takes); None when `key` is not checked against a list of choices."""
  try:
    build(configured(base, {key: PROBE}))
  except UserError as e:
    found = re.search(rf"{re.escape(key.split('.')[-1])}='{PROBE}'.* must be one of "
                      r"((?:'[^']*'(?:, )?)+)", str(e))
    return tuple(re.findall(r"'([^']*)'", found.group(1))) if found else None
  return None


def sweep_changes(base: ml_collections.ConfigDict) -> list[tuple[str, object]]:
  """(key, value) for every boolean flipped and every other value of every choice key."""
  changes = []
  for key, value in walk(base):
    if isinstance(value, bool):
      changes.append((key, not value))
    elif isinstance(value, str) and key not in FREE_FORM:
      values = choice_values(base, key)
      changes += [(key, v) for v in values or () if v != value]
  return changes


def companions(tmp_path, key: str, value) -> dict:
  """What a change needs beside it: the file sources a pattern of files to read."""
  if (key, value) == ("data.source", "files"):
    (tmp_path / "text.txt").write_bytes(bytes(range(32, 127)) * 40)
    return {"data.pattern": str(tmp_path / "*.txt")}
  if (key, value) == ("data.source", "array_record"):
    from array_record.python.array_record_module import ArrayRecordWriter
    writer = ArrayRecordWriter(str(tmp_path / "tokens.array_record"), "group_size:1")
    for record in np.random.default_rng(0).integers(0, 256, (40, 50), dtype=np.int32):
      writer.write(record.astype("<i4").tobytes())
    writer.close()
    return {"data.pattern": str(tmp_path / "*.array_record")}
  return {}


def assert_one_line_naming(error: UserError, *keys: str) -> None:
  text = str(error)
  assert "\n" not in text.strip(), text
  for key in keys:
    assert key.split(".")[-1] in text, f"the refusal does not name {key}: {text}"


def pack(base, changes, tmp_path) -> list[dict]:
  """The changes in as few runs as the settings accept together: each change joins the
  first run that takes it (one value per key a run), else starts one. A change refused on
  its own must be a limit of this platform, in one line naming its key and the platform; one
  refused beside a run that took each of its changes alone, a combination refused in one
  line naming both."""
  runs = []
  for key, value in changes:
    change = {key: value, **companions(tmp_path, key, value)}
    try:
      build(configured(base, change))
    except UserError as e:  # alone, only what this platform cannot run may be refused
      assert_one_line_naming(e, key)
      platform = jax.devices()[0].platform
      assert platform in str(e).lower(), f"{key}={value!r} refused on its own: {e}"
      continue
    for run in runs:
      if key in run:
        continue
      try:
        build(configured(base, {**run, **change}))
      except UserError as e:
        assert_one_line_naming(e, key)
        assert any(k.split(".")[-1] in str(e) for k in run), (
            f"{key}={value!r} refused beside {run}: the line names no key of the run: {e}")
        continue
      run.update(change)
      break
    else:
      runs.append(dict(change))
  return runs


@pytest.fixture(scope="module")
def base() -> ml_collections.ConfigDict:
  c = tiny_config(train_steps=2, log_every=1, eval_every=2, checkpoint_every=2)
  c.data.batch_size, c.data.seq_len = 8, 16
  return c


def test_the_sweep_finds_every_kind_of_switch(base):
  """The discovery itself: the known booleans and choice keys are among what it sweeps."""
  keys = {key for key, _ in sweep_changes(base)}
  assert {"moe_metrics", "traffic.record", "tie_embeddings", "moe.use_ring_of_experts",
          "remat_policy", "remat_unit", "attention_impl", "rope_layout", "rope_scaling.type",
          "data.source", "moe.moe_dropless_fallback", "moe.dropless_fallback_chunking",
          "moe.gmm_impl", "moe.a2a_impl", "moe.router_score", "dtype",
          "autopilot.objective"} <= keys, keys


@pytest.mark.slow
def test_every_switch_trains_or_is_refused_in_one_line(base, tmp_path):
  runs = pack(base, sweep_changes(base), tmp_path)
  assert 1 < len(runs) <= 8, runs  # packed: a handful of programs, not one per value
  for i, run in enumerate(runs):
    losses = trainer.train_and_evaluate(build(configured(base, run)), str(tmp_path / f"{i}"))
    assert len(losses) == base.train_steps and np.all(np.isfinite(losses)), (run, losses)
