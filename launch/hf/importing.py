"""`launch.convert --from_hf`: a Hugging Face checkpoint as a launcher run at step 0.

The run's config is the given one with the model keys of the checkpoint's config.json
(`hf_config.model_keys`); its checkpoint 0 holds the parameters, read leaf by leaf into their
shards (`reading`), a fresh optimizer state and the data's start, in the format `launch.train`
writes, with the run's record `config.json`, so `launch.train --workdir=W` fine-tunes from it.
"""
from __future__ import annotations

import json
import os
import shutil

import jax
import jax.numpy as jnp
import ml_collections

import metrics
import moe_hk
from launch.checkpoints import store
from launch.data import loader as data_lib
from launch.hf import hf_config, reading
from launch.hf.family import Tensor
from launch.model import spikes, train_step as steps_lib
from launch.setup import settings as settings_lib
from launch.setup.errors import user_errors

SOURCE = "hf_source.json"        # in the workdir: the family, dtype and config.json imported
# What a checkpoint folder may hold besides the weights that the run keeps and exports.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json", "tokenizer.model", "vocab.json", "merges.txt")


def configured(config: ml_collections.ConfigDict, keys: dict) -> ml_collections.ConfigDict:
  """`config` with the dotted `keys` set (the checkpoint's model keys win)."""
  config = ml_collections.ConfigDict(config.to_dict())
  for dotted, value in keys.items():
    *parents, name = dotted.split(".")
    node = config
    for part in parents:
      node = node[part]
    node[name] = value
  return config


def _params(source: reading.SafetensorsFolder, tensors: list[Tensor], abstract) -> dict:
  """Every parameter leaf of `abstract` (shapes and shardings), read from `source` as
  `tensors` (the family's names for the model's leaves) say."""
  tensors = {(t.module, t.name): t for t in tensors}
  leaves = {(m, n) for m, names in abstract.items() for n in names}
  assert leaves == set(tensors), f"leaves and tensors that do not pair: {leaves ^ set(tensors)}"
  return {module: {name: reading.read_leaf(source, tensors[module, name], leaf.shape,
                                           leaf.sharding)
                   for name, leaf in names.items()} for module, names in abstract.items()}


def _state(settings: settings_lib.Settings, steps: steps_lib.Steps, params: dict):
  """The train state at step 0 around `params`: a fresh optimizer state and spike window."""
  config, sharding = settings.config, steps.state_sharding
  tx = steps_lib.make_optimizer(config)[0]
  opt_state = jax.jit(tx.init, out_shardings=sharding.opt_state)(params)
  window = spikes.empty(config.spikes.window) if config.spikes.enabled else None
  return steps_lib.TrainState(jax.device_put(jnp.zeros((), jnp.int32), sharding.step), params,
                              opt_state, jax.device_put(window, sharding.spikes))


def _save(settings: settings_lib.Settings, workdir: str, state) -> None:
  """Checkpoint 0 of the run in `workdir`, in the trainer's format."""
  config = settings.config
  with user_errors():
    data = data_lib.make_data(config, process_index=jax.process_index(),
                              process_count=jax.process_count())
  saver = store.Checkpoints(workdir, keep=config.checkpoints_to_keep,
                                  every=config.checkpoint_every)
  saver.save(0, state, {"data": store.GetSetState(data), "moe_metrics": metrics.Aggregator()})
  saver.wait()
  saver.close()


def _record(folder: str, workdir: str, config: ml_collections.ConfigDict, hf: dict,
            dtype: str) -> None:
  """The run's record (config.json), what was imported, the tokenizer."""
  settings_lib.save(config, workdir)
  with open(os.path.join(workdir, SOURCE), "w") as f:
    json.dump({"from": os.path.abspath(folder), "dtype": dtype, "config": hf}, f, indent=2)
  for name in TOKENIZER_FILES:
    if os.path.isfile(os.path.join(folder, name)):
      shutil.copy(os.path.join(folder, name), os.path.join(workdir, name))


def import_checkpoint(folder: str, workdir: str, config: ml_collections.ConfigDict) -> str:
  """Writes `workdir` as a run at step 0 from the Hugging Face checkpoint in `folder`, its
  training settings from `config`; returns the semantics mapped, for the console."""
  hf = hf_config.read(folder)
  keys = hf_config.model_keys(hf)
  family = hf_config.family_of(hf)
  settings = settings_lib.build(configured(config, keys), jax.device_count())
  mesh = moe_hk.make_mesh(**settings.mesh)
  steps = steps_lib.make_steps(settings, mesh)
  abstract = steps_lib.abstract_inputs(settings.config, steps)[0]
  os.makedirs(workdir, exist_ok=True)
  tensors = family.tensors(keys)
  with reading.SafetensorsFolder(folder) as source:
    dtype = source.dtype(tensors[0].hf)
    state = _state(settings, steps, _params(source, tensors, abstract.params))
  _save(settings, workdir, state)
  if jax.process_index() == 0:
    _record(folder, workdir, settings.config, hf, dtype)
  return hf_config.semantics(keys, family) + f"\nstored dtype {dtype}"
