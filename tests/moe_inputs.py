"""Parameters and inputs with controllable router skew, for layer tests."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from moe_hk import MoEConfig, MoEParams, mesh as mesh_lib, mesh_forward, param_specs
from moe_hk.expert_types import ExpertWeights
from moe_hk import shard_forward
from tests import reference


def skewed_inputs(config: MoEConfig, batch: int, seq: int, *, skew: float, seed: int = 0,
                  hot=None, hot_rows=None):
  """Random `MoEParams` and `x [B, S, D]` whose router prefers the `hot` experts.

  Every token is x = noise + mu; the hot experts' router columns get `skew * mu / |mu|^2`, so
  their logits rise by about `skew` for every token (by `skew` only for batch rows in
  `hot_rows` when given, which makes only some shards' traffic skewed).
  """
  rng = np.random.default_rng(seed)
  d, f, e = config.emb_dim, config.mlp_dim, config.num_experts
  hot = list(range(config.num_experts_per_tok)) if hot is None else list(hot)
  mu = rng.normal(size=d)
  x = rng.normal(size=(batch, seq, d))
  router_w = rng.normal(size=(d, e)) / np.sqrt(d)
  x[slice(None) if hot_rows is None else hot_rows] += mu
  router_w[:, hot] += skew * (mu / (mu @ mu))[:, None]
  params = MoEParams(
      router_w=router_w,
      wi_0=rng.normal(size=(e, d, f)) / np.sqrt(d),
      wi_1=rng.normal(size=(e, d, f)) / np.sqrt(d),
      wo=rng.normal(size=(e, f, d)) / np.sqrt(f))
  as32 = lambda a: jnp.asarray(a, jnp.float32)
  return MoEParams(*map(as32, params)), as32(x)


def outputs_and_grads(fn, params, x, cotangent):
  """`fn(params, x) -> (y, aux)`; returns y, aux and the gradients wrt (params, x) of
  `sum(y * cotangent)`."""
  def loss(p, xx):
    y, aux = fn(p, xx)
    return jnp.sum(y * cotangent), (y, aux)
  (_, (y, aux)), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, x)
  return y, aux, grads


def dense_reference(k: int, score: str = "softmax", keep=None, weights_on: str = "output"):
  """The tests' reference as `fn(params, x) -> (y, None)` with MoEParams-shaped gradients."""
  def fn(params, x):
    return reference.reference_moe(tuple(params), x, k=k, score=score, keep=keep,
                                   weights_on=weights_on), None
  return fn


@functools.partial(jax.jit, static_argnames=("k", "score", "weights_on"))
def reference_outputs_and_grads(params, x, cotangent, keep=None, *, k: int,
                                score: str = "softmax", weights_on: str = "output"):
  """`outputs_and_grads` of `dense_reference(k, score, keep, weights_on)`, compiled: one
  program per shape instead of an eager dispatch (and compile) per primitive."""
  return outputs_and_grads(dense_reference(k, score, keep, weights_on), params, x, cotangent)


def per_device_stats(config: MoEConfig, mesh: Mesh, params: MoEParams, x, fields: tuple[str, ...]):
  """Runs one shard's layer on every device; returns `y` and, per name in `fields`, that
  `MoEStats` field as seen by each device `[num_devices]` (before any reduction)."""
  backends = mesh_forward.resolve_backends(config, mesh)
  axes = tuple(mesh.axis_names)

  def per_device(x_, router_w, wi_0, wi_1, wo):
    shard = shard_forward.size(x_.shape, config, mesh.shape[config.expert_axis])
    y, local = shard_forward.moe_shard(x_, router_w, ExpertWeights(wi_0, wi_1, wo),
                                       config=config, backends=backends, mesh_axes=axes,
                                       shard=shard)
    return y, tuple(getattr(local, f)[None] for f in fields)

  batch = mesh_lib.batch_spec(mesh)
  fn = jax.shard_map(per_device, mesh=mesh, in_specs=(batch, *param_specs(config, mesh)),
                     out_specs=(batch, tuple(P(axes) for _ in fields)), check_vma=False)
  y, values = jax.jit(fn)(x, *params)
  return y, dict(zip(fields, values))
