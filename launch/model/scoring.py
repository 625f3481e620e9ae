"""The run's model as a scorer: float32 logits of token ids, and per-token losses.

Shapes: B batch, S sequence, V vocabulary.
"""
from __future__ import annotations

from typing import Callable

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import moe_hk
from launch.model import loss, transformer as model_lib
from launch.setup.settings import Settings
from moe_hk import buffer_size, fallback, shard_forward

Forward = Callable[[hk.Params, jax.Array], tuple[jax.Array, moe_hk.MoEStats]]


def forward(settings: Settings, mesh: Mesh) -> Forward:
  """A jitted `(params, tokens [B, S] int32) -> (float32 logits [B, S, V], MoEStats stacked
  over the MoE layers)` of the run's model (B divisible by the mesh's devices)."""
  config = settings.config

  def apply(tokens):
    out = model_lib.Transformer(config, settings.layer, mesh, name="model")(tokens)
    scores = loss.logits(out.hidden, out.embeddings)
    return scores, out.moe_stats
  model = hk.transform(apply)
  batch = NamedSharding(mesh, P(tuple(mesh.axis_names)))
  return jax.jit(lambda params, tokens: model.apply(params, None, tokens),
                 in_shardings=(None, batch))


def fitted(settings: Settings, shape: tuple[int, int], devices: int) -> tuple[Settings, str]:
  """The run's settings for scoring `shape = (B, S)` tokens (B a multiple of `devices`), and a
  note: as they are (no note), or, when no chunk count of the dropless fallback fits so few
  tokens per device (a short text on many expert shards), with the worst-case buffer, which
  drops nothing either, and a note saying so."""
  layer, shards = settings.layer, settings.expert_shards
  shard = shard_forward.size((shape[0] // devices, shape[1], layer.emb_dim), layer, shards)
  if not shard.builds_fallback:
    return settings, ""
  try:
    fallback.fallback_num_chunks(
        batch=shard.batch, seq=shard.seq, k=shard.k, shards=shards, local_experts=shard.local,
        rows=shard.capped_rows, requested=layer.dropless_fallback_num_chunks)
  except ValueError:
    note = (f"{shard.seq} positions are too few for the fallback's chunks at ragged_buffer_factor="
            f"{layer.ragged_buffer_factor:g} on {shards} expert shards: scored with the "
            "worst-case buffer, which drops nothing either")
    return settings._replace(layer=layer.replace(
        ragged_buffer_factor=buffer_size.WORST_CASE)), note
  return settings, ""


def padded(tokens: np.ndarray, multiple: int) -> np.ndarray:
  """`tokens [B, S]` with rows of zeros appended up to a multiple of `multiple` rows."""
  extra = -tokens.shape[0] % multiple
  return np.concatenate([tokens, np.zeros((extra, tokens.shape[1]), tokens.dtype)])


def token_losses(logits: np.ndarray, tokens: np.ndarray) -> np.ndarray:
  """`[B, S - 1]` float32: -log p(tokens[:, t + 1] | tokens[:, :t + 1]) from `logits [B, S, V]`."""
  log_p = jax.nn.log_softmax(jnp.asarray(logits[:, :-1], jnp.float32), axis=-1)
  return -np.asarray(jnp.take_along_axis(log_p, jnp.asarray(tokens[:, 1:, None]), -1)[..., 0])
