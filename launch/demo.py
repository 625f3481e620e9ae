"""Demo of the MoE layer on 8 simulated CPU devices: capped vs worst-case buffer.

Runs one skewed batch forward and backward through the layer with a capped receive buffer and
with the worst-case buffer, and prints how far apart they are, the buffer factor the traffic
needed and the rows the cap dropped.

  python -m launch.demo [--shards=8] [--experts=16] [--top_k=2] [--factor=1.0] [--skew=3]
"""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
if os.environ["JAX_PLATFORMS"] == "cpu":
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_force_host_platform_device_count=8").strip()

import json  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

import moe_hk  # noqa: E402

_SHARDS = flags.DEFINE_integer("shards", 8, "Expert-parallel shards (the rest of the devices "
                               "form the data axis).")
_EXPERTS = flags.DEFINE_integer("experts", 16, "Routed experts.")
_TOP_K = flags.DEFINE_integer("top_k", 2, "Experts per token.")
_FACTOR = flags.DEFINE_float("factor", 1.0, "ragged_buffer_factor of the capped run (> 0).")
_SKEW = flags.DEFINE_float("skew", 1.0, "How strongly the router prefers two hot experts.")
_BATCH = flags.DEFINE_integer("batch", 16, "Global batch.")
_SEQ = flags.DEFINE_integer("seq", 128, "Sequence length.")


def _skewed_batch(config, batch, seq, skew, seed=0):
  """Random params and tokens whose router logits favour experts 0 and 1 by about `skew`."""
  rng = np.random.default_rng(seed)
  d, f, e = config.emb_dim, config.mlp_dim, config.num_experts
  mu = rng.normal(size=d)
  router_w = rng.normal(size=(d, e)) / np.sqrt(d)
  router_w[:, :2] += skew * (mu / (mu @ mu))[:, None]
  params = moe_hk.MoEParams(router_w, rng.normal(size=(e, d, f)) / np.sqrt(d),
                            rng.normal(size=(e, d, f)) / np.sqrt(d),
                            rng.normal(size=(e, f, d)) / np.sqrt(f))
  x = rng.normal(size=(batch, seq, d)) + mu
  return jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), (params, x))


def run(shards, experts, top_k, factor, skew, batch, seq):
  """Returns the demo's figures as a dict."""
  mesh = moe_hk.make_mesh(data=jax.device_count() // shards, expert=shards)
  capped = moe_hk.MoEConfig(num_experts=experts, num_experts_per_tok=top_k, emb_dim=64,
                            mlp_dim=128, ragged_buffer_factor=factor)
  params, x = _skewed_batch(capped, batch, seq, skew)
  results = {}
  for name, config in [("capped", capped), ("worst_case", capped.replace(ragged_buffer_factor=-1))]:
    def loss(p, xx, config=config):
      y, stats = moe_hk.moe_forward(p, xx, config=config, mesh=mesh)
      return jnp.mean(y ** 2), (y, stats)
    (_, (y, stats)), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params, x)
    results[name] = (y, stats, grads)
  (y_c, stats_c, g_c), (y_w, stats_w, g_w) = results["capped"], results["worst_case"]
  rel = lambda a, b: float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))
  return {
      "mesh": dict(mesh.shape), "experts": experts, "top_k": top_k,
      "ragged_buffer_factor": factor,
      "required_buffer_factor": float(stats_c.required_factor),
      "routed_rows": batch * seq * top_k,
      "dropped_rows_capped": int(stats_c.dropped_rows),
      "dropped_rows_worst_case": int(stats_w.dropped_rows),
      "output_rel_diff": rel(y_c, y_w),
      "grad_rel_diff": {k: rel(a, b) for k, a, b in zip(moe_hk.MoEParams._fields, g_c, g_w)},
  }


def main(argv):
  del argv
  out = run(_SHARDS.value, _EXPERTS.value, _TOP_K.value, _FACTOR.value, _SKEW.value,
            _BATCH.value, _SEQ.value)
  print(json.dumps(out, indent=2))
  print(f"\nrequired buffer factor {out['required_buffer_factor']:.3f} vs cap "
        f"{out['ragged_buffer_factor']}: the capped layer dropped {out['dropped_rows_capped']} "
        f"of {out['routed_rows']} routed rows (worst-case buffer: "
        f"{out['dropped_rows_worst_case']}); outputs differ by {out['output_rel_diff']:.3g} "
        "(relative norm).")


if __name__ == "__main__":
  app.run(main)
