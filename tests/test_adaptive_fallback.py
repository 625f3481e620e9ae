"""Adaptive fallback chunking: the fewest chunks that fit, dropless results, one rung everywhere."""
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moe_hk
from moe_hk import dispatch_plan, fallback
from tests import reference
from tests.moe_inputs import dense_reference, outputs_and_grads, per_device_stats, skewed_inputs
from tests.tree_close import assert_trees_close, relative_error

PATHS = pytest.mark.parametrize("ring", [False, True], ids=["all_to_all", "ring"])

# 8 shards, 16 experts, top-2, factor 1.25, one 64-token row per shard: R = 160 rows, and
# only chunks of 8 tokens fit the worst case (8 x 8 x 2 = 128 rows): ladder 2, 8.
SHARDS, EXPERTS, K, FACTOR, BATCH, SEQ = 8, 16, 2, 1.25, 8, 64
LADDER = (2, 8)


def _config(**kw):
  base = dict(num_experts=EXPERTS, num_experts_per_tok=K, emb_dim=16, mlp_dim=32,
              ragged_buffer_factor=FACTOR, gmm_block_rows=8, moe_dropless_fallback="layer",
              dropless_fallback_chunking="adaptive")
  return moe_hk.MoEConfig(**{**base, **kw})


@functools.lru_cache(maxsize=None)
def _step(config, mesh_shape=(("expert", SHARDS),), **kw):
  """Jitted `(params, x, cotangent) -> (y, stats, grads)` of the layer, one per setting."""
  mesh = moe_hk.make_mesh(**dict(mesh_shape))
  layer = functools.partial(moe_hk.moe_forward, config=config, mesh=mesh, **kw)
  return jax.jit(functools.partial(outputs_and_grads, layer))


def reference_chunks(ids, *, num_devices: int, shards: int, num_experts: int, rungs,
                     rows: int) -> int:
  """Chunks the adaptive fallback must run (0: the capped layer), by plain loops.

  `ids [B, S, K]`: routing of `num_devices` devices in mesh order, `shards` consecutive ones
  per expert group. Returns the first of 1 and `rungs` whose every chunk (the c-th block of
  T / n of a device's tokens in (b, s) order) sends at most `rows` rows to every receiver's
  experts, summed over the group's senders.
  """
  k = np.shape(ids)[-1]
  per_device = np.asarray(ids).reshape(num_devices, -1, k)  # [dev, T, K]
  tokens = per_device.shape[1]
  local = num_experts // shards
  for n in (1, *rungs):
    fits = True
    for group in range(num_devices // shards):
      for c in range(n):
        for receiver in range(shards):
          load = 0
          for sender in range(shards):
            chunk = per_device[group * shards + sender][c * tokens // n:(c + 1) * tokens // n]
            load += int(np.sum(chunk // local == receiver))
          fits = fits and load <= rows
    if fits:
      return 0 if n == 1 else n
  raise AssertionError(f"no rung of {rungs} fits {rows} rows")


def _routing(config, params, x):
  return reference.reference_routing(params.router_w, x, config.num_experts_per_tok,
                                     config.router_score)[0]


def _rows(config, shards, tokens):
  return reference.reference_buffer_rows(tokens, config.num_experts_per_tok, shards,
                                         config.num_experts // shards,
                                         config.ragged_buffer_factor)


def test_chunk_ladder():
  assert fallback.chunk_ladder(8) == (2, 8)
  assert fallback.chunk_ladder(12) == (2, 12)
  assert fallback.chunk_ladder(9) == (3, 9)
  assert fallback.chunk_ladder(7) == (7,)
  for n in range(2, 97):
    ladder = fallback.chunk_ladder(n)
    assert len(ladder) <= 2 and ladder[-1] == n and n % ladder[0] == 0, (n, ladder)
    assert all(n % d for d in range(2, ladder[0])), (n, ladder)  # the smallest divisor


def test_rung_choice_matches_loops():
  """The pure selection (fine counts -> merged chunk loads -> first fit) on one expert group."""
  shards, experts, k, batch, seq = 4, 8, 2, 2, 16
  rng = np.random.default_rng(0)
  chosen = set()
  for skew, rows in itertools.product((0.0, 1.0, 3.0), (32, 40, 48, 64, 96)):
    # Expert 0's extra share and the buffer set the fitting rung.
    logits = rng.normal(size=(shards * batch, seq, experts))
    logits[..., 0] += skew
    ids = np.argsort(-logits, axis=-1)[..., :k]
    fine = jnp.stack([fallback.chunk_counts(jnp.asarray(i), LADDER[-1], experts)
                      for i in ids.reshape(shards, batch, seq, k)])  # [P, n, E]
    flags = fallback.rung_overflows(fine, (1, *LADDER), rows)
    got = (0, *LADDER)[int(fallback.first_fit(flags))]
    want = reference_chunks(ids, num_devices=shards, shards=shards, num_experts=experts,
                            rungs=LADDER, rows=rows)
    assert got == want, (skew, rows, np.asarray(flags))
    chosen.add(got)
  assert chosen == {0, *LADDER}, chosen


def test_chunk_receiver_rows_merges_fine_chunks():
  fine = jnp.arange(2 * 4 * 4).reshape(2, 4, 4)  # [P=2, n=4, E=4]: L = 2
  np.testing.assert_array_equal(dispatch_plan.chunk_receiver_rows(fine, 1),
                                np.asarray(fine).reshape(2, 4, 2, 2).sum((0, 1, 3))[None])
  halves = dispatch_plan.chunk_receiver_rows(fine, 2)
  np.testing.assert_array_equal(halves[1], np.asarray(fine)[:, 2:].reshape(2, 2, 2, 2)
                                .sum((0, 1, 3)))


def test_switch_with_recompute_matches_switch():
  branches = (lambda o, a: o[0] * a, lambda o, a: jnp.sin(o[0]) * o[1],
              lambda o, a: o[0] * o[1] ** 3)
  ops, aux = (jnp.arange(1.0, 4.0), jnp.float32(0.5)), jnp.float32(2.0)
  for index in range(3):
    def loss(fn, o):
      return jnp.sum(fn(index, branches, o, aux))
    plain = jax.value_and_grad(functools.partial(loss, jax.lax.switch))(ops)
    recompute = jax.value_and_grad(functools.partial(loss, fallback.switch_with_recompute))(ops)
    assert_trees_close(recompute, plain, rtol=1e-6, what=f"branch {index}")


@PATHS
@pytest.mark.parametrize("skew,severity", [(0.0, "mild"), (2.0, "severe")])
def test_adaptive_equals_dropless(ring, skew, severity):
  config = _config(use_ring_of_experts=ring)
  params, x = skewed_inputs(config, BATCH, SEQ, skew=skew, seed=1)
  cot = jax.random.normal(jax.random.key(3), x.shape)
  want = reference_chunks(_routing(config, params, x), num_devices=SHARDS, shards=SHARDS,
                          num_experts=EXPERTS, rungs=LADDER,
                          rows=_rows(config, SHARDS, BATCH // SHARDS * SEQ))
  assert (want == 2) if severity == "mild" else (want > 2), want

  y, stats, grads = _step(config)(params, x, cot)
  y_ref, _, grads_ref = _step(config.replace(ragged_buffer_factor=-1))(params, x, cot)
  assert int(stats.would_drop_rows) > 0, "the case must really overflow the capped buffer"
  assert int(stats.fallback) == 1 and int(stats.dropped_rows) == 0
  assert int(stats.fallback_chunks) == want
  assert_trees_close(y, y_ref, what="y")
  assert_trees_close(grads, grads_ref, what="grad")

  # Control: the capped model without the fallback drops rows and diverges.
  y_cap, stats_cap, grads_cap = _step(config.replace(moe_dropless_fallback="none"))(
      params, x, cot)
  assert int(stats_cap.dropped_rows) > 0 and int(stats_cap.fallback_chunks) == 0
  assert relative_error(y_cap, y_ref) > 1e-2
  assert relative_error(grads_cap[0].wo, grads_ref[0].wo) > 1e-2

  # Fixed chunking runs (and reports) the worst-case count whatever the overflow.
  _, stats_fixed, _ = _step(config.replace(dropless_fallback_chunking="fixed"))(params, x, cot)
  assert int(stats_fixed.fallback_chunks) == LADDER[-1]


@PATHS
def test_no_overflow_equals_model_without_fallback(ring):
  config = _config(use_ring_of_experts=ring, ragged_buffer_factor=3.0)
  params, x = skewed_inputs(config, BATCH, SEQ, skew=0.0, seed=1)
  cot = jax.random.normal(jax.random.key(4), x.shape)
  y, stats, grads = _step(config)(params, x, cot)
  y_plain, stats_plain, grads_plain = _step(config.replace(moe_dropless_fallback="none"))(
      params, x, cot)
  assert int(stats.would_drop_rows) == 0 and int(stats.fallback) == 0
  assert int(stats.fallback_chunks) == 0
  assert_trees_close((y, grads), (y_plain, grads_plain), rtol=1e-6, what="no overflow")
  assert_trees_close(stats, stats_plain, rtol=0, what="stats")


@PATHS
def test_asymmetric_overflow_takes_one_rung_everywhere(ring):
  """Only the first expert group's tokens are skewed: it alone needs chunks, the other group
  alone would run capped, and every device runs the first group's rung."""
  mesh = moe_hk.make_mesh(data=2, expert=4)
  config = _config(use_ring_of_experts=ring, ragged_buffer_factor=1.5)
  batch, seq, ladder = 16, 16, fallback.chunk_ladder(4)
  params, x = skewed_inputs(config, batch, seq, skew=2.0, seed=0, hot_rows=slice(0, 8))
  ids = np.asarray(_routing(config, params, x))
  rung = functools.partial(reference_chunks, shards=4, num_experts=EXPERTS, rungs=ladder,
                           rows=_rows(config, 4, batch // 8 * seq))
  per_group = [rung(ids[g * 8:(g + 1) * 8], num_devices=4) for g in range(2)]
  assert per_group[0] > 0 and per_group[1] == 0, per_group
  assert rung(ids, num_devices=8) == per_group[0]

  y, seen = per_device_stats(config, mesh, params, x, ("fallback_chunks", "dropped_rows"))
  chunks, dropped = seen["fallback_chunks"], seen["dropped_rows"]
  np.testing.assert_array_equal(chunks, per_group[0])
  np.testing.assert_array_equal(dropped, 0)
  assert_trees_close(y, dense_reference(K)(params, x)[0], what="y")
