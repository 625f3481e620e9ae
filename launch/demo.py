"""Demo of the MoE layer, capped vs worst-case buffer, on the accelerator or 8 CPU devices.

Runs one skewed batch forward and backward through the layer with a capped receive buffer and
with the worst-case buffer, and prints how far apart they are, the buffer factor the traffic
needed and the rows the cap dropped. Without a TPU or GPU it runs on 8 simulated CPU devices.

  python -m launch.demo [--shards=8] [--experts=16] [--top_k=2] [--factor=1.0] [--skew=3]
"""
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

import moe_hk
from launch import cli, platform
from launch.errors import UserError

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
  # No fallback (MoEConfig's default is 'layer'): the capped run drops what overflows.
  capped = moe_hk.MoEConfig(num_experts=experts, num_experts_per_tok=top_k, emb_dim=64,
                            mlp_dim=128, ragged_buffer_factor=factor,
                            moe_dropless_fallback="none")
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


def _require(valid: bool, flag: str, value: object, what: str) -> None:
  if not valid:
    raise UserError(f"--{flag}={value}: must be {what}.")


def check_flags(shards: int, experts: int, top_k: int, factor: float, skew: float, batch: int,
                seq: int, devices: int) -> None:
  """Raises UserError for the first flag the demo cannot run with on `devices` devices."""
  _require(shards >= 1 and devices % shards == 0, "shards", shards,
           f"a divisor of the {devices} devices")
  _require(experts >= 1 and experts % shards == 0, "experts", experts,
           f"a positive multiple of --shards={shards} (each shard holds experts / shards)")
  _require(1 <= top_k <= experts, "top_k", top_k, f"in [1, --experts={experts}]")
  _require(math.isfinite(factor) and factor > 0, "factor", factor,
           "a buffer factor > 0 (1.0: the balanced rows)")
  _require(math.isfinite(skew), "skew", skew, "a finite number")
  _require(batch >= 1 and batch % devices == 0, "batch", batch,
           f"a positive multiple of the {devices} devices (the batch is sharded over all)")
  _require(seq >= 1, "seq", seq, "at least 1")


def main(argv):
  del argv  # launch.cli refuses arguments that are not flags
  platform.setup()
  values = (_SHARDS.value, _EXPERTS.value, _TOP_K.value, _FACTOR.value, _SKEW.value,
            _BATCH.value, _SEQ.value)
  check_flags(*values, devices=jax.device_count())
  out = run(*values)
  print(json.dumps(out, indent=2))
  print(f"\nrequired buffer factor {out['required_buffer_factor']:.3f} vs cap "
        f"{out['ragged_buffer_factor']}: the capped layer dropped {out['dropped_rows_capped']} "
        f"of {out['routed_rows']} routed rows (worst-case buffer: "
        f"{out['dropped_rows_worst_case']}); outputs differ by {out['output_rel_diff']:.3g} "
        "(relative norm).")


if __name__ == "__main__":
  cli.run(main)
