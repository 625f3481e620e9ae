"""The accelerator backends on one real GPU: native ragged all-to-all, `ragged_dot`, blocked.

  python -m benchmarks.gpu_native [--rounds=20]   # on a GPU, with jax's CUDA plugin installed

A single device cannot exchange rows with peers, but the layer's native path still runs end to
end (a one-shard `ragged_all_to_all`, `ragged_dot` grouped matmuls), so this checks on a real
GPU what CPU tests can only compile: (1) the capped layer with a skewed router, the `layer`
fallback and the worst-case buffer against the dense einsum reference (outputs and gradients),
(2) `ragged_dot` and the `blocked` backend against a dense batched matmul with the same useful
FLOPs, forward and forward + backward, in float32 and bfloat16, (3) step time and compiled
memory of a layer with the full buffer vs one that falls back to chunks. The layer sections run
both grouped-matmul backends. Prints JSON, then tables.
"""
from __future__ import annotations

import argparse
import functools
import itertools
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

import moe_hk
from benchmarks import timing
from launch import platform
from moe_hk import grouped_matmul


def skewed_layer(num_experts: int, k: int, width: int, hidden: int, batch: int, seq: int,
                 skew: float, seed: int = 0):
  """Params and input whose router sends most tokens to the first k experts."""
  rng = np.random.default_rng(seed)
  mu = rng.normal(size=width)
  x = rng.normal(size=(batch, seq, width)) + mu
  router = rng.normal(size=(width, num_experts)) / np.sqrt(width)
  router[:, :k] += skew * (mu / (mu @ mu))[:, None]
  params = moe_hk.MoEParams(
      router, rng.normal(size=(num_experts, width, hidden)) / np.sqrt(width),
      rng.normal(size=(num_experts, width, hidden)) / np.sqrt(width),
      rng.normal(size=(num_experts, hidden, width)) / np.sqrt(hidden))
  return moe_hk.MoEParams(*(jnp.asarray(p, jnp.float32) for p in params)), jnp.asarray(
      x, jnp.float32)


def dense_moe(params: moe_hk.MoEParams, x: jax.Array, k: int) -> jax.Array:
  """Every expert on every token, then the top-k softmax-weighted sum (no drops)."""
  logits = jnp.einsum("bsd,de->bse", x, params.router_w)
  top, ids = jax.lax.top_k(logits, k)
  weights = jax.nn.softmax(top, axis=-1)
  h = jax.nn.silu(jnp.einsum("bsd,edf->bsef", x, params.wi_0)) * jnp.einsum(
      "bsd,edf->bsef", x, params.wi_1)
  every = jnp.einsum("bsef,efd->bsed", h, params.wo)
  return jnp.einsum("bsk,bskd->bsd", weights, jnp.take_along_axis(every, ids[..., None], 2))


def rel(a, b) -> float:
  return float(jnp.linalg.norm((a - b).ravel()) / jnp.linalg.norm(b.ravel()))


def check_layer() -> dict:
  """Capped (drops), fallback and worst case vs the dense reference, fwd and grads."""
  mesh = moe_hk.make_mesh(expert=1, devices=jax.devices()[:1])
  k, seq = 2, 256
  params, x = skewed_layer(8, k, 128, 256, 4, seq, skew=4.0)
  cot = jax.random.normal(jax.random.key(1), x.shape)

  def value_and_grads(fn):
    def loss(p, xx):
      y = fn(p, xx)
      return jnp.sum(y * cot), y
    (_, y), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x)
    return y, grads

  y_ref, g_ref = value_and_grads(functools.partial(dense_moe, k=k))
  out = {}
  for (name, factor, mode), gmm in itertools.product(
      (("capped", 0.5, "none"), ("fallback", 0.5, "layer"), ("worst_case", -1, "none")),
      ("ragged_dot", "blocked")):
    config = moe_hk.MoEConfig(num_experts=8, num_experts_per_tok=k, emb_dim=128, mlp_dim=256,
                              ragged_buffer_factor=factor, moe_dropless_fallback=mode,
                              a2a_impl="auto", gmm_impl=gmm)
    layer = functools.partial(moe_hk.moe_forward, config=config, mesh=mesh)
    y, grads = value_and_grads(lambda p, xx: layer(p, xx)[0])
    stats = jax.jit(layer)(params, x)[1]
    out[f"{name}_{gmm}"] = {"y_rel_err": rel(y, y_ref),
                 "grad_rel_err_max": max(rel(a, b) for a, b in zip(jax.tree.leaves(grads),
                                                                    jax.tree.leaves(g_ref))),
                 "dropped_rows": int(stats.dropped_rows), "fallback": int(stats.fallback),
                 "required_factor": float(stats.required_factor)}
  return out


def time_grouped_matmul(rounds: int) -> dict:
  """ragged_dot and the blocked backend vs a dense batched matmul of the same useful FLOPs
  (balanced groups)."""
  results = {}
  for dtype in (jnp.float32, jnp.bfloat16):
    m, kk, n, g = 32768, 5120, 8192, 8
    rng = np.random.default_rng(0)
    lhs = jnp.asarray(rng.normal(size=(m, kk)), dtype)
    rhs = jnp.asarray(rng.normal(size=(g, kk, n)) / np.sqrt(kk), dtype)
    sizes = jnp.full((g,), m // g, jnp.int32)
    dense = lambda a, b: jnp.einsum("gmk,gkn->gmn", a.reshape(g, m // g, kk), b)
    ragged = lambda a, b: jax.lax.ragged_dot(a, b, sizes)
    blocked = lambda a, b: grouped_matmul.blocked_grouped_matmul(a, b, sizes, block_rows=512)
    grad_of = lambda f: jax.jit(jax.grad(lambda a, b: jnp.sum(f(a, b).astype(jnp.float32)),
                                         argnums=(0, 1)))
    fns = {"dense_batched": functools.partial(jax.jit(dense), lhs, rhs),
           "ragged_dot": functools.partial(jax.jit(ragged), lhs, rhs),
           "blocked": functools.partial(jax.jit(blocked), lhs, rhs),
           "dense_batched_fwd_bwd": functools.partial(grad_of(dense), lhs, rhs),
           "ragged_dot_fwd_bwd": functools.partial(grad_of(ragged), lhs, rhs),
           "blocked_fwd_bwd": functools.partial(grad_of(blocked), lhs, rhs)}
    samples = timing.interleaved(fns, rounds)
    fwd = timing.ratio_summary({k: samples[k] for k in ("dense_batched", "ragged_dot", "blocked")},
                               "dense_batched")
    bwd = timing.ratio_summary({k: samples[k] for k in ("dense_batched_fwd_bwd",
                                                        "ragged_dot_fwd_bwd", "blocked_fwd_bwd")},
                               "dense_batched_fwd_bwd")
    flops = 2 * m * kk * n
    for s in fwd.values():
      s["tflops"] = flops / s["median_s"] / 1e12
    results[jnp.dtype(dtype).name] = {"shape": [m, kk, n, g], **fwd, **bwd}
  return results


def time_fallback_step(rounds: int) -> dict:
  """Value-and-grad step of one bf16 layer: the full buffer vs the `layer` fallback.

  With one shard the worst case is the balanced size (N rows), so a factor of 1 is never
  capped, and 0.5 always overflows and falls back to 2 sequence chunks of N / 2 rows.
  """
  mesh = moe_hk.make_mesh(expert=1, devices=jax.devices()[:1])
  k, width, hidden, batch, seq = 1, 1024, 4096, 8, 4096
  params, x = skewed_layer(16, k, width, hidden, batch, seq, skew=0.0, seed=2)
  x = x.astype(jnp.bfloat16)
  fns, memory = {}, {}
  for (name, factor), gmm in itertools.product(
      (("full_buffer", 1.0), ("fallback_2_chunks", 0.5)), ("ragged_dot", "blocked")):
    name = f"{name}_{gmm}"
    config = moe_hk.MoEConfig(num_experts=16, num_experts_per_tok=k, emb_dim=width,
                              mlp_dim=hidden, ragged_buffer_factor=factor,
                              moe_dropless_fallback="layer", a2a_impl="auto",
                              gmm_impl=gmm, dtype="bfloat16")
    def loss(p, xx, config=config):
      y, stats = moe_hk.moe_forward(p, xx, config=config, mesh=mesh)
      return jnp.mean(jnp.square(y.astype(jnp.float32))), stats
    step = jax.jit(jax.value_and_grad(loss, has_aux=True))
    fns[name] = functools.partial(step, params, x)
    assert int(step(params, x)[0][1].fallback) == (factor < 1), name
    m = step.lower(params, x).compile().memory_analysis()
    memory[name] = int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
                       - m.alias_size_in_bytes)
  summary = timing.ratio_summary(timing.interleaved(fns, rounds), "full_buffer_ragged_dot")
  for name, s in summary.items():
    s["memory_MiB"] = memory[name] / 2 ** 20
  return summary


def main():
  platform.setup()
  if jax.default_backend() != "gpu":
    sys.exit(f"benchmarks.gpu_native needs a GPU; jax runs on {platform.describe()}.")
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rounds", type=int, default=20)
  parser.add_argument("--sections", default="layer,gmm,fallback",
                      help="Comma-separated subset of layer, gmm, fallback.")
  args = parser.parse_args()
  mesh = moe_hk.make_mesh(expert=1, devices=jax.devices()[:1])
  backends = moe_hk.mesh_forward.resolve_backends(moe_hk.MoEConfig(1, 1, 1, 1), mesh)
  result = {"device": str(jax.devices()[0]), "jax": jax.__version__,
            "backends": backends._asdict()}
  sections = (("layer", "layer_vs_dense_reference", check_layer),
              ("gmm", "grouped_matmul", lambda: time_grouped_matmul(args.rounds)),
              ("fallback", "fallback_step", lambda: time_fallback_step(args.rounds)))
  for key, name, fn in sections:
    if key not in args.sections.split(","):
      continue
    try:
      result[name] = fn()
    except Exception as e:  # report every section, even when one fails
      result[name] = {"error": f"{type(e).__name__}: {str(e)[:500]}"}
  print(json.dumps(result, indent=2))
  if "error" not in result.get("grouped_matmul", {"error": None}):
    for dtype, r in result["grouped_matmul"].items():
      timing.print_table(f"ragged_dot vs dense batched, {dtype}, {r['shape']}",
                         {k: v for k, v in r.items() if k != "shape"}, "dense_batched")
  if "error" not in result.get("fallback_step", {"error": None}):
    timing.print_table("one bf16 layer's value-and-grad step", result["fallback_step"],
                       "full_buffer_ragged_dot")


if __name__ == "__main__":
  main()
