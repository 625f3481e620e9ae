"""Demo of the MoE layer, capped vs worst-case buffer, on the accelerator or 8 CPU devices.

Runs one skewed batch forward and backward through one MoE layer (`config.moe`, width
`config.emb_dim`, batch `config.data.batch_size` x `config.data.seq_len`, on the mesh
`config.mesh`) with its capped receive buffer and no fallback, and with the worst-case buffer,
and prints how far apart they are, the buffer factor the traffic needed and the rows the cap
dropped. Without a TPU or GPU it runs on `config.cpu_devices` simulated CPU devices.

  python -m launch.demo [--skew=1] [--config.moe.ragged_buffer_factor=1.0 ...]
"""
import dataclasses
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

import moe_hk
from launch.setup import cli, platform, settings as settings_lib
from launch.setup.errors import UserError

_CONFIG = cli.define_config("config", "demo.py", "The layer's configuration (its config.moe, "
                            "emb_dim, data.batch_size, data.seq_len and mesh).")
_SKEW = flags.DEFINE_float("skew", 1.0, "How strongly the router prefers two hot experts.")


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


def run(settings: settings_lib.Settings, skew: float) -> dict:
  """Returns the demo's figures as a dict."""
  mesh = moe_hk.make_mesh(**settings.mesh)
  # No fallback: the capped run drops what overflows.
  capped = dataclasses.replace(settings.layer, moe_dropless_fallback="none")
  batch, seq = settings.config.data.batch_size, settings.config.data.seq_len
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
      "mesh": dict(mesh.shape), "experts": capped.num_experts,
      "top_k": capped.num_experts_per_tok, "ragged_buffer_factor": capped.ragged_buffer_factor,
      "required_buffer_factor": float(stats_c.required_factor),
      "routed_rows": batch * seq * capped.num_experts_per_tok,
      "dropped_rows_capped": int(stats_c.dropped_rows),
      "dropped_rows_worst_case": int(stats_w.dropped_rows),
      "output_rel_diff": rel(y_c, y_w),
      "grad_rel_diff": {k: rel(a, b) for k, a, b in zip(moe_hk.MoEParams._fields, g_c, g_w)},
  }


def main(argv):
  del argv  # launch.setup.cli refuses arguments that are not flags
  if not math.isfinite(_SKEW.value):
    raise UserError(f"--skew={_SKEW.value}: must be a finite number.")
  config = _CONFIG.value
  platform.setup(settings_lib.cpu_devices(config))
  settings = settings_lib.build(config, jax.device_count(), platform=jax.devices()[0].platform)
  if not settings.layer.capped:
    raise UserError("config.moe.ragged_buffer_factor=-1 is the worst-case buffer: the demo "
                    "compares a capped buffer (> 0) with it.")
  out = run(settings, _SKEW.value)
  print(json.dumps(out, indent=2))
  print(f"\nrequired buffer factor {out['required_buffer_factor']:.3f} vs cap "
        f"{out['ragged_buffer_factor']}: the capped layer dropped {out['dropped_rows_capped']} "
        f"of {out['routed_rows']} routed rows (worst-case buffer: "
        f"{out['dropped_rows_worst_case']}); outputs differ by {out['output_rel_diff']:.3g} "
        "(relative norm).")


if __name__ == "__main__":
  cli.run(main)
