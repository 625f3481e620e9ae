"""Adaptive fallback chunking: the fewest chunks that fit, dropless results, one rung everywhere."""
import contextlib
import functools
import io
import itertools
import math
import re

import jax
import jax.numpy as jnp
from jax import ad_checkpoint
import numpy as np
import pytest

import moe_hk
from moe_hk import buffer_size, dispatch_plan, fallback
from tests import reference
from tests.moe_inputs import dense_reference, outputs_and_grads, per_device_stats, skewed_inputs
from tests.tree_close import assert_trees_close, relative_error

# Per path, the cases share compiled steps (`_step`): each path's cases run on one worker
# (tests/conftest.py WORKER_GROUPS).
# The all-to-all path's compiled cases are marked slow: `make test-fast` runs the ring's.
PATHS = pytest.mark.parametrize("ring", [pytest.param(False, marks=pytest.mark.slow), True],
                                ids=["all_to_all", "ring"])

# 8 shards, 16 experts, top-2, factor 1.25, one 64-token row per shard: R = 160 rows and a
# worst case of 8 x 64 x 2 = 1024, so only chunks of 8 tokens always fit (128 rows).
SHARDS, EXPERTS, K, FACTOR, BATCH, SEQ = 8, 16, 2, 1.25, 8, 64
ROWS, WORST, MAX_CHUNKS = 160, 1024, 8
LADDER = fallback.traffic_ladder(seq=SEQ, capped_rows=ROWS, worst_rows=WORST,
                                 max_chunks=MAX_CHUNKS)
Rung = fallback.Rung


def _config(**kw):
  base = dict(num_experts=EXPERTS, num_experts_per_tok=K, emb_dim=16, mlp_dim=32,
              ragged_buffer_factor=FACTOR, gmm_impl="ragged_dot", moe_dropless_fallback="layer",
              dropless_fallback_chunking="adaptive")
  return moe_hk.MoEConfig(**{**base, **kw})


@functools.lru_cache(maxsize=None)
def _step(config, mesh_shape=(("expert", SHARDS),), **kw):
  """Jitted `(params, x, cotangent) -> (y, stats, grads)` of the layer, one per setting."""
  mesh = moe_hk.make_mesh(**dict(mesh_shape))
  layer = functools.partial(moe_hk.moe_forward, config=config, mesh=mesh, **kw)
  return jax.jit(functools.partial(outputs_and_grads, layer))


def reference_rung(ids, *, num_devices: int, shards: int, num_experts: int, ladder,
                   rows: int) -> Rung:
  """The rung the adaptive fallback must run, by plain loops: `Rung(1, rows)` (the capped
  layer) or the first of `ladder` whose every chunk (the c-th block of T / n of a device's
  tokens in (b, s) order) sends at most its rung's rows to every receiver's experts, summed
  over the group's senders.

  `ids [B, S, K]`: routing of `num_devices` devices in mesh order, `shards` consecutive ones
  per expert group.
  """
  k = np.shape(ids)[-1]
  per_device = np.asarray(ids).reshape(num_devices, -1, k)  # [dev, T, K]
  tokens = per_device.shape[1]
  local = num_experts // shards
  for rung in (Rung(1, rows), *ladder):
    n = rung.chunks
    fits = True
    for group in range(num_devices // shards):
      for c in range(n):
        for receiver in range(shards):
          load = 0
          for sender in range(shards):
            chunk = per_device[group * shards + sender][c * tokens // n:(c + 1) * tokens // n]
            load += int(np.sum(chunk // local == receiver))
          fits = fits and load <= rung.rows
    if fits:
      return rung
  raise AssertionError(f"no rung of {ladder} fits")


def _routing(config, params, x):
  return reference.reference_routing(params.router_w, x, config.num_experts_per_tok,
                                     config.router_score)[0]


def _rows(config, shards, tokens):
  return buffer_size.buffer_rows(shards, tokens, config.num_experts_per_tok,
                                 config.num_experts // shards, config.ragged_buffer_factor)


def test_traffic_ladder_worked_example():
  """The docstring's example: 8 shards, top-2, 16 experts, factor 1.5, 2,048 tokens."""
  ladder = fallback.traffic_ladder(seq=256, capped_rows=6144, worst_rows=32768, max_chunks=8)
  assert ladder == ((2, 3868), (4, 2435), (4, 3065), (4, 3859), (8, 2429), (8, 3058),
                    (8, 4096)), ladder


@pytest.mark.parametrize("seq,capped_rows,worst_rows", [
    (SEQ, ROWS, WORST), (256, 6144, 32768), (512, 16384, 32768), (24, 100, 960),
    (49, 70, 490), (512, 4096, 65536), (16, 32, 256), (64, 800, 1024)])
def test_traffic_ladder_tracks_the_traffic_within_capped_buffers(seq, capped_rows, worst_rows):
  # The automatic chunk count: the fewest chunks whose worst case fits the capped buffer.
  max_chunks = next(n for n in range(1, seq + 1)
                    if seq % n == 0 and worst_rows // n <= capped_rows)
  ladder = fallback.traffic_ladder(seq=seq, capped_rows=capped_rows, worst_rows=worst_rows,
                                   max_chunks=max_chunks)
  *rungs, fixed = ladder
  assert fixed == fallback.fixed_rung(capped_rows=capped_rows, worst_rows=worst_rows,
                                      max_chunks=max_chunks)
  assert fixed.chunks * fixed.rows == worst_rows  # the fixed rung fits every routing
  for rung in ladder:
    assert seq % rung.chunks == 0 and 2 <= rung.chunks <= max_chunks, ladder
    assert rung.rows <= fixed.rows <= capped_rows, ladder  # no chunk's buffer exceeds the fixed one
  # Rung i holds g^i capped buffers in all (rounded up to whole rows per chunk), each below
  # its chunks' worst case; the rungs stop one step short of the fixed rung's total, or at
  # LADDER_RUNGS.
  growth, ratio = fallback.LADDER_GROWTH, worst_rows / capped_rows
  steps = math.floor(math.log(ratio) / math.log(growth) + 1e-9) - 1
  assert len(rungs) == max(0, min(steps, fallback.LADDER_RUNGS)), ladder
  for i, rung in enumerate(rungs, start=1):
    total = rung.chunks * rung.rows / capped_rows
    assert growth ** i <= total < growth ** i + rung.chunks / capped_rows, (i, ladder)
    assert rung.rows < worst_rows // rung.chunks, ladder
    assert rung.chunks == min(n for n in range(math.ceil(growth ** i * capped_rows / fixed.rows),
                                               seq + 1) if seq % n == 0), ladder
  if len(rungs) < fallback.LADDER_RUNGS:
    assert ratio < growth ** (len(rungs) + 2), ladder


def test_traffic_ladder_with_requested_chunks():
  """8 chunks requested where 2 hold the worst case: the rungs keep the requested chunks'
  buffer (4096 rows), so every rung runs 8 chunks, of fewer rows than the fixed one."""
  assert fallback.traffic_ladder(seq=512, capped_rows=16384, worst_rows=32768,
                                 max_chunks=8) == ((8, 2579), (8, 3246), (8, 4096))


def test_rung_choice_matches_loops():
  """The pure selection (fine counts -> merged chunk loads -> first fit) on one expert group."""
  shards, experts, k, batch, seq = 4, 8, 2, 2, 16
  worst = shards * batch * seq * k
  rng = np.random.default_rng(0)
  chosen = set()
  for skew, rows in itertools.product((0.0, 1.0, 3.0, 8.0), (32, 40, 48, 64, 96)):
    # Experts 0 and 1 (receiver 0's) get an extra share; it and the buffer set the rung.
    logits = rng.normal(size=(shards * batch, seq, experts))
    logits[..., :2] += skew
    ids = np.argsort(-logits, axis=-1)[..., :k]
    max_chunks = fallback.fallback_num_chunks(batch=batch, seq=seq, k=k, shards=shards,
                                              local_experts=experts // shards, rows=rows)
    ladder = (Rung(1, rows), *fallback.traffic_ladder(
        seq=seq, capped_rows=rows, worst_rows=worst, max_chunks=max_chunks))
    fine = jnp.stack([fallback.chunk_counts(jnp.asarray(i), fallback.finest_chunks(ladder),
                                            experts)
                      for i in ids.reshape(shards, batch, seq, k)])  # [P, f, E]
    flags = fallback.rung_overflows(fine, ladder)
    got = ladder[int(fallback.first_fit(flags))]
    want = reference_rung(ids, num_devices=shards, shards=shards, num_experts=experts,
                          ladder=ladder[1:], rows=rows)
    assert got == want, (skew, rows, np.asarray(flags))
    chosen.add("capped" if got.chunks == 1 else "fixed" if got == ladder[-1] else "rung")
  assert chosen == {"capped", "rung", "fixed"}, chosen


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


def _checkpointed_switch(index, branches, operands, aux):
  """A switch over branches each checkpointed saving nothing, bare: the form an enclosing
  remat policy reaches into (the control below)."""
  return jax.lax.switch(index, [jax.checkpoint(fn, policy=jax.checkpoint_policies.nothing_saveable)
                                for fn in branches], operands, aux)


@pytest.mark.parametrize("outer", [None, "save_only_these_names", "dots_with_no_batch_dims_saveable"])
def test_switch_with_recompute_keeps_its_inputs_not_a_branchs_activations(outer):
  """What the backward holds of the switch: its operands and index (`print_saved_residuals`),
  none of the taken branch's `[64, 64]` intermediates, also inside a remat whose policy
  would save them (a named one, a matmul's). The controls keep them: a bare `lax.switch`
  (every branch's, too), and under an enclosing policy a switch of checkpointed branches."""
  def branch(o, a):
    h = ad_checkpoint.checkpoint_name(jnp.tanh(o[0][:, None] @ o[1][None, :]), "h")
    return jnp.sum(jnp.sin(h) * h, axis=1) * a
  branches = (lambda o, a: o[0] * a, branch)
  ops, aux = (jnp.arange(1.0, 65.0), jnp.ones(64)), jnp.float32(2.0)
  policy = {None: None, "save_only_these_names":
            jax.checkpoint_policies.save_only_these_names("h"),
            "dots_with_no_batch_dims_saveable":
            jax.checkpoint_policies.dots_with_no_batch_dims_saveable}[outer]

  def saved(switch) -> list[str]:
    fn = lambda o: switch(1, branches, o, aux)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
      ad_checkpoint.print_saved_residuals(fn if policy is None else
                                          jax.checkpoint(fn, policy=policy), ops)
    return re.findall(r"\b[a-z]+\d+\[[\d,]*\]", printed.getvalue())  # dtype[shape]
  kept = saved(fallback.switch_with_recompute)
  assert kept and all(shape in ("f32[64]", "f32[]", "i32[]") for shape in kept), kept
  control = jax.lax.switch if policy is None else _checkpointed_switch
  assert "f32[64,64]" in saved(control)


@PATHS
@pytest.mark.parametrize("skew,seed,severity", [(0.0, 16, "mild"), (1.0, 1, "severe")])
def test_adaptive_equals_dropless(ring, skew, seed, severity):
  config = _config(use_ring_of_experts=ring)
  params, x = skewed_inputs(config, BATCH, SEQ, skew=skew, seed=seed)
  cot = jax.random.normal(jax.random.key(3), x.shape)
  assert _rows(config, SHARDS, BATCH // SHARDS * SEQ) == ROWS
  want = reference_rung(_routing(config, params, x), num_devices=SHARDS, shards=SHARDS,
                        num_experts=EXPERTS, ladder=LADDER, rows=ROWS)
  # Mild: two chunks of a traffic-sized buffer, smaller than the capped one; severe: more.
  if severity == "mild":
    assert want.chunks == 2 and want.rows < ROWS, want
  else:
    assert want.chunks > 2 and want != LADDER[-1], want

  y, stats, grads = _step(config)(params, x, cot)
  y_ref, _, grads_ref = _step(config.replace(ragged_buffer_factor=-1))(params, x, cot)
  assert int(stats.would_drop_rows) > 0, "the case must really overflow the capped buffer"
  assert int(stats.fallback) == 1 and int(stats.dropped_rows) == 0
  assert int(stats.fallback_chunks) == want.chunks
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
  assert int(stats_fixed.fallback_chunks) == LADDER[-1].chunks == MAX_CHUNKS


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
  batch, seq = 16, 16
  rows = _rows(config, 4, batch // 8 * seq)  # 96 rows; worst case 256, in 4 chunks of 64
  ladder = fallback.traffic_ladder(seq=seq, capped_rows=rows, worst_rows=256, max_chunks=4)
  params, x = skewed_inputs(config, batch, seq, skew=2.0, seed=0, hot_rows=slice(0, 8))
  ids = np.asarray(_routing(config, params, x))
  rung = functools.partial(reference_rung, shards=4, num_experts=EXPERTS, ladder=ladder,
                           rows=rows)
  per_group = [rung(ids[g * 8:(g + 1) * 8], num_devices=4) for g in range(2)]
  assert per_group[0].chunks > 1 and per_group[1].chunks == 1, per_group
  assert rung(ids, num_devices=8) == per_group[0]

  y, seen = per_device_stats(config, mesh, params, x, ("fallback_chunks", "dropped_rows"))
  chunks, dropped = seen["fallback_chunks"], seen["dropped_rows"]
  np.testing.assert_array_equal(chunks, per_group[0].chunks)
  np.testing.assert_array_equal(dropped, 0)
  assert_trees_close(y, dense_reference(K)(params, x)[0], what="y")
