"""Grouped matmul on CPU vs a dense batched matmul with the same useful FLOPs.

  python -m benchmarks.grouped_matmul [--rows=4096 --k=512 --n=1024 --groups=8 --rounds=15]

Prints JSON, then two tables: the forward product, and forward plus the gradients of both
operands (value_and_grad of `sum(out * cotangent)`), each against its dense batched
equivalent `[G, M/G, K] @ [G, K, N]`, the floor: the grouped product does exactly its useful
work, but with ragged group sizes. `ragged_dot` on XLA:CPU multiplies every row by every group
(masked), so it pays G times; it is timed forward only.
"""
import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import timing
from launch.setup import platform, results
from moe_hk import grouped_matmul

BLOCK_ROWS = (128, 256, 512)


def value_and_grads(product):
  """`product(lhs, rhs, sizes)` -> jitted `(lhs, rhs, sizes, cot) -> (sum(out * cot), (dlhs,
  drhs))`."""
  loss = lambda lhs, rhs, sizes, cot: jnp.sum(product(lhs, rhs, sizes) * cot)
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


def variants(lhs, rhs, cot, sizes: dict[str, jax.Array], backward: bool) -> dict:
  """Zero-argument calls to time, dense batched first: forward only, or with `backward`
  value_and_grad against the cotangent `cot [M, N]`."""
  (m, k), (g, _, n) = lhs.shape, rhs.shape
  dense = lambda a, b, _: jnp.einsum("gmk,gkn->gmn", a.reshape(g, m // g, k), b).reshape(m, n)
  products = {"dense_batched": (dense, {"": sizes["balanced"]})}
  for rows in BLOCK_ROWS:
    blocked = functools.partial(grouped_matmul.blocked_grouped_matmul, block_rows=rows)
    products[f"blocked_b{rows}"] = (blocked, sizes)
  if not backward:
    products["ragged_dot"] = (jax.lax.ragged_dot, {"balanced": sizes["balanced"]})
  fns = {}
  for name, (product, cases) in products.items():
    call = value_and_grads(product) if backward else jax.jit(product)
    extra = (cot,) if backward else ()
    for case, case_sizes in cases.items():
      label = f"{name}_{case}" if case else name
      fns[label] = functools.partial(call, lhs, rhs, case_sizes, *extra)
  return fns


def main():
  platform.setup(cpu_devices=1, cpu_only=True)
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rows", type=int, default=4096)
  parser.add_argument("--k", type=int, default=512)
  parser.add_argument("--n", type=int, default=1024)
  parser.add_argument("--groups", type=int, default=8)
  parser.add_argument("--rounds", type=int, default=15)
  results.add_argument(parser, "grouped_matmul")
  args = parser.parse_args()
  m, k, n, g = args.rows, args.k, args.n, args.groups
  rng = np.random.default_rng(0)
  lhs = jnp.asarray(rng.normal(size=(m, k)), jnp.float32)
  rhs = jnp.asarray(rng.normal(size=(g, k, n)), jnp.float32)
  cot = jnp.asarray(rng.normal(size=(m, n)), jnp.float32)
  # Uneven but same total: a realistic skew (one hot expert with a third of the rows).
  uneven = np.full(g, (m - m // 3) // (g - 1)); uneven[0] = m - uneven[1:].sum()
  sizes = {"balanced": jnp.full((g,), m // g, jnp.int32), "uneven": jnp.asarray(uneven, jnp.int32)}

  result = {"shape": {"rows": m, "k": k, "n": n, "groups": g}, "rounds": args.rounds,
            "platform": jax.devices()[0].platform, "results": {}}
  for mode, backward in (("forward", False), ("forward_backward", True)):
    samples = timing.interleaved(variants(lhs, rhs, cot, sizes, backward), args.rounds)
    result["results"][mode] = timing.ratio_summary(samples, "dense_batched")
  results.publish(args.results, result)
  for mode, summary in result["results"].items():
    timing.print_table(f"{mode}: grouped matmul {m}x{k}x{n} over {g} groups "
                       f"({args.rounds} rounds)", summary, "dense_batched")


if __name__ == "__main__":
  main()
