"""Writes a run's parameters as a Hugging Face checkpoint: safetensors files of at most
`max_shard_bytes` each (one leaf on the host at a time), with `model.safetensors.index.json`
when there are several, as `save_pretrained` lays them out."""
from __future__ import annotations

import json
import os
from typing import Any, Iterator

import ml_dtypes
import numpy as np
from jax.experimental import multihost_utils
from safetensors.numpy import save_file

from launch.hf.family import Tensor

_METADATA = {"format": "pt"}  # what transformers expects of a safetensors file it loads


def _fused(tensors: list[Tensor]) -> list[list[Tensor]]:
  """`tensors` grouped by the Hugging Face tensor they fill, in order: one each, or the
  leaves whose columns make one tensor (in column order)."""
  groups: dict[tuple, list[Tensor]] = {}
  for tensor in tensors:
    groups.setdefault((tensor.hf, tensor.period, tensor.offset), []).append(tensor)
  return [sorted(g, key=lambda t: t.columns[0] if t.columns else 0) for g in groups.values()]


def hf_tensors(params: Any, tensors: list[Tensor], dtype: str
               ) -> Iterator[tuple[str, np.ndarray]]:
  """(name, array in `dtype`) of every Hugging Face tensor in `params`, one layer of one
  tensor's leaves on the host at a time (every process takes part in each gather)."""
  cast = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
  for group in _fused(tensors):
    first = group[0]
    leaves = [params[t.module][t.name] for t in group]
    for layer in range(leaves[0].shape[0]) if first.stacked else [None]:
      parts = [np.asarray(multihost_utils.process_allgather(
          leaf if layer is None else leaf[layer], tiled=True)) for leaf in leaves]
      for ids in np.ndindex(*parts[0].shape[:max(first.stacked - 1, 0)]):
        block = np.concatenate([part[ids] for part in parts], axis=-1)
        name = first.hf_name(ids if layer is None else (layer, *ids))
        yield name, np.ascontiguousarray((block.T if first.transpose else block).astype(cast))


def _shards(named: Iterator[tuple[str, np.ndarray]], max_bytes: int
            ) -> Iterator[dict[str, np.ndarray]]:
  """`named` grouped in order into dicts of at most `max_bytes` (a larger tensor alone)."""
  shard, size = {}, 0
  for name, array in named:
    if shard and size + array.nbytes > max_bytes:
      yield shard
      shard, size = {}, 0
    shard[name] = array
    size += array.nbytes
  if shard:
    yield shard


def write(folder: str, named: Iterator[tuple[str, np.ndarray]], max_bytes: int) -> list[str]:
  """Writes `named` to `folder`: `model.safetensors`, or `model-0000i-of-0000n.safetensors`
  and their index past `max_bytes`; returns the files written."""
  os.makedirs(folder, exist_ok=True)
  written, weight_map, total = [], {}, 0
  for i, shard in enumerate(_shards(named, max_bytes)):
    path = os.path.join(folder, f"part-{i:05d}.safetensors")
    save_file(shard, path, metadata=_METADATA)
    written.append(path)
    weight_map.update((name, i) for name in shard)
    total += sum(a.nbytes for a in shard.values())
  if len(written) == 1:
    final = [os.path.join(folder, "model.safetensors")]
  else:
    final = [os.path.join(folder, f"model-{i + 1:05d}-of-{len(written):05d}.safetensors")
             for i in range(len(written))]
  for temporary, name in zip(written, final):
    os.replace(temporary, name)
  if len(final) > 1:
    index = {"metadata": {"total_size": total},
             "weight_map": {n: os.path.basename(final[i]) for n, i in weight_map.items()}}
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
      json.dump(index, f, indent=2)
  return final
