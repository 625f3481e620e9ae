"""Reads a Hugging Face checkpoint's safetensors straight into sharded parameters.

Each parameter leaf is made with `jax.make_array_from_callback`: every device's shard is read
from the files as the slices it holds (`safe_open(...).get_slice`), so a process reads only what
its own devices hold, one leaf at a time, and no host ever holds the whole model.
"""
from __future__ import annotations

import contextlib
import glob
import json
import os
from typing import Any

import jax
import numpy as np
from safetensors import safe_open

from launch.hf.family import Tensor
from launch.setup.errors import UserError


class SafetensorsFolder(contextlib.ExitStack):
  """The tensors of a folder's `*.safetensors` files (with or without their index), opened
  lazily; a context manager that closes them."""

  def __init__(self, folder: str):
    super().__init__()
    self.folder = folder
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
      with open(index) as f:
        self.files = dict(json.load(f)["weight_map"])
    else:
      self.files = {}
      for path in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        with safe_open(path, "numpy") as f:
          self.files.update((name, os.path.basename(path)) for name in f.keys())
    if not self.files:
      raise UserError(f"--from_hf={folder}: no *.safetensors there; pass a Hugging Face "
                      "checkpoint folder (config.json and *.safetensors).")
    self._open: dict[str, Any] = {}

  def slice(self, name: str):
    """The lazy slice of tensor `name` (index it to read)."""
    if name not in self.files:
      raise UserError(f"--from_hf={self.folder}: tensor {name} is missing (the family's "
                      "layout needs it).")
    file = self.files[name]
    if file not in self._open:
      self._open[file] = self.enter_context(safe_open(os.path.join(self.folder, file),
                                                      "numpy"))
    return self._open[file].get_slice(name)

  def dtype(self, name: str) -> str:
    """The stored dtype of tensor `name`, as numpy names it ('float32', 'bfloat16', ...)."""
    stored = self.slice(name).get_dtype()
    return {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}.get(stored, stored.lower())


def _check_shape(tensor: Tensor, name: str, got: list[int], leaf: tuple[int, ...]) -> None:
  """UserError when the file's tensor is not the shape the leaf needs."""
  want = list(leaf[tensor.stacked:])
  want = want[::-1] if tensor.transpose else want
  if tensor.columns is not None:
    want[-1] = tensor.columns[2]
  if got != want:
    raise UserError(f"tensor {name} is {got}, the model from config.json needs {want}.")


def read_block(source: SafetensorsFolder, tensor: Tensor, shape: tuple[int, ...],
               index: tuple[slice, ...]) -> np.ndarray:
  """`leaf[index]` of the leaf `tensor` of `shape`, in float32, read from `source`."""
  lead = [range(*s.indices(n)) for s, n in zip(index[:tensor.stacked], shape)]
  inner = tuple(index[tensor.stacked:])
  inner = inner[::-1] if tensor.transpose else inner
  if tensor.columns is not None:  # the leaf's columns are a range of the tensor's
    start, stop, _ = tensor.columns
    wanted = range(*inner[-1].indices(stop - start))
    inner = (*inner[:-1], slice(start + wanted.start, start + wanted.stop))
  blocks = []
  for ids in np.ndindex(*(len(r) for r in lead)):
    name = tensor.hf_name(tuple(r[i] for r, i in zip(lead, ids)))
    part = source.slice(name)
    _check_shape(tensor, name, part.get_shape(), shape)
    block = np.asarray(part[inner], np.float32)
    blocks.append(block.T if tensor.transpose else block)
  out = np.stack(blocks) if lead else blocks[0]
  return out.reshape(tuple(len(r) for r in lead) + blocks[0].shape)


def read_leaf(source: SafetensorsFolder, tensor: Tensor, shape: tuple[int, ...],
              sharding: jax.sharding.Sharding) -> jax.Array:
  """The float32 leaf `tensor` of `shape`, each addressable shard read from `source`."""
  return jax.make_array_from_callback(
      shape, sharding, lambda index: read_block(source, tensor, shape, index))
