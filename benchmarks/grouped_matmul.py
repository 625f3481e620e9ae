"""Grouped matmul on CPU vs a dense batched matmul with the same useful FLOPs.

  python -m benchmarks.grouped_matmul [--rows=4096 --k=512 --n=1024 --groups=8 --rounds=15]

Prints JSON, then a table. The dense batched matmul `[G, M/G, K] @ [G, K, N]` is the floor:
the grouped product does exactly its useful work, but with ragged group sizes. `ragged_dot` on
XLA:CPU multiplies every row by every group (masked), so it pays G times.
"""
import argparse
import functools
import json

from benchmarks import timing

import jax  # noqa: E402  (timing sets the platform first)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from moe_hk import grouped_matmul  # noqa: E402


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rows", type=int, default=4096)
  parser.add_argument("--k", type=int, default=512)
  parser.add_argument("--n", type=int, default=1024)
  parser.add_argument("--groups", type=int, default=8)
  parser.add_argument("--rounds", type=int, default=15)
  args = parser.parse_args()
  m, k, n, g = args.rows, args.k, args.n, args.groups
  rng = np.random.default_rng(0)
  lhs = jnp.asarray(rng.normal(size=(m, k)), jnp.float32)
  rhs = jnp.asarray(rng.normal(size=(g, k, n)), jnp.float32)
  balanced = jnp.full((g,), m // g, jnp.int32)
  # Uneven but same total: a realistic skew (one hot expert with a third of the rows).
  uneven = np.full(g, (m - m // 3) // (g - 1)); uneven[0] = m - uneven[1:].sum()
  uneven = jnp.asarray(uneven, jnp.int32)

  dense = jax.jit(lambda a, b: jnp.einsum("gmk,gkn->gmn", a.reshape(g, m // g, k), b))
  fns = {"dense_batched": lambda: dense(lhs, rhs)}
  for rows in (128, 256, 512):
    blocked = jax.jit(functools.partial(grouped_matmul.blocked_grouped_matmul, block_rows=rows))
    fns[f"blocked_b{rows}_balanced"] = functools.partial(blocked, lhs, rhs, balanced)
    fns[f"blocked_b{rows}_uneven"] = functools.partial(blocked, lhs, rhs, uneven)
  ragged = jax.jit(jax.lax.ragged_dot)
  fns["ragged_dot_balanced"] = functools.partial(ragged, lhs, rhs, balanced)

  summary = timing.ratio_summary(timing.interleaved(fns, args.rounds), "dense_batched")
  result = {"shape": {"rows": m, "k": k, "n": n, "groups": g}, "rounds": args.rounds,
            "platform": jax.devices()[0].platform, "results": summary}
  print(json.dumps(result, indent=2))
  timing.print_table(f"grouped matmul {m}x{k}x{n} over {g} groups ({args.rounds} rounds)",
                     summary, "dense_batched")


if __name__ == "__main__":
  main()
