"""The dropless fallback: chunk rule, and outputs/gradients equal to the dropless model."""
import functools

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

import moe_hk
from moe_hk import fallback, mesh as mesh_lib, mesh_forward, shard_forward
from moe_hk.expert_types import ExpertWeights
from tests.moe_inputs import (dense_reference, outputs_and_grads, per_device_stats,
                               reference_outputs_and_grads, skewed_inputs)
from tests.tree_close import assert_trees_close, relative_error

NUM_DEVICES = 8
BATCH = 16  # 2 per device

# (expert shards, experts, top-k, factor, sequence): every case overflows its capped buffer.
OVERFLOW = [(4, 8, 2, 0.5, 16), (8, 8, 1, 0.25, 32), (2, 4, 2, 0.4, 16), (8, 16, 4, 0.5, 16)]
ONE_SHARD = (1, 8, 2, 0.75, 16)


def _config(experts, k, factor, **kw):
  return moe_hk.MoEConfig(**{**dict(num_experts=experts, num_experts_per_tok=k, emb_dim=16,
                                    mlp_dim=32, ragged_buffer_factor=factor, gmm_block_rows=8,
                                    gmm_impl="ragged_dot"), **kw})


def _layer(config, mesh, **kw):
  return functools.partial(moe_hk.moe_forward, config=config, mesh=mesh, **kw)


# (case, path, chunking, grouped matmul, extras): every case on both paths with fixed chunking;
# the grouped matmul is XLA's `ragged_dot` (the quickest to compile) except on the first case,
# which runs the CPU default `blocked` on both paths, and one case per path with the megablox
# kernels (interpreted, slow) and fixed chunking: the grouped matmuls are
# tests/test_grouped_matmul.py's subject. Adaptive chunking on one case per path, the quickest
# to compile (its ladder is the shortest), with `ragged_dot` (tests/test_adaptive_fallback.py
# is its subject; with megablox its switch compiled in 54 s, against 22 + 15 s for the two
# cases apart);
# `force_dropless` and the step mode's layer on one case each (tests/test_step_mode.py covers
# step mode on both paths).
_EXTRAS = {(OVERFLOW[0], False, "fixed"): ("force_dropless",),
           (OVERFLOW[3], True, "fixed"): ("step",)}
# `make test-fast` runs the third case's fixed chunking on both paths (the quickest); the rest
# are marked slow.
_FAST = {(OVERFLOW[2], False, "fixed", "ragged_dot"), (OVERFLOW[2], True, "fixed", "ragged_dot"),
         (ONE_SHARD, False, "fixed", "ragged_dot")}
FALLBACK_CASES = [
    pytest.param(*case, ring, chunking, gmm, _EXTRAS.get((case, ring, chunking), ()) if
                 gmm != "megablox" else (), id="-".join(
                     [*map(str, case), "ring" if ring else "all_to_all", chunking, gmm]),
                 marks=() if (case, ring, chunking, gmm) in _FAST else pytest.mark.slow)
    for case, ring, chunking, gmm in
    [(case, ring, "fixed", "blocked" if case == OVERFLOW[0] else "ragged_dot")
     for case in OVERFLOW for ring in (False, True)]
    + [(OVERFLOW[2], False, "adaptive", "ragged_dot"), (OVERFLOW[2], True, "adaptive",
                                                        "ragged_dot"),
       (OVERFLOW[2], False, "fixed", "megablox"), (OVERFLOW[3], True, "fixed", "megablox"),
       # One expert shard (a single chip): its balanced load overflows a factor below 1, and
       # its exchange is a local copy (`all_to_all.local_ragged_all_to_all`).
       (ONE_SHARD, False, "fixed", "ragged_dot")]]
# The experts' embedding dim sharded over an fsdp axis: each fallback chunk gathers them, and
# their gradients come back reduce-scattered chunk by chunk.
FALLBACK_CASES.append(pytest.param(*OVERFLOW[0], False, "fixed", "ragged_dot", ("fsdp",),
                                   id="-".join(map(str, OVERFLOW[0])) + "-fsdp2-fixed"))


@pytest.mark.parametrize("shards,experts,k,factor,seq,ring,chunking,gmm,extras", FALLBACK_CASES)
def test_layer_fallback_equals_dropless(ring, shards, experts, k, factor, seq, chunking, gmm,
                                        extras):
  groups = NUM_DEVICES // shards
  mesh = (moe_hk.make_mesh(data=1, fsdp=groups, expert=shards) if "fsdp" in extras else
          moe_hk.make_mesh(data=groups, expert=shards))
  config = _config(experts, k, factor, use_ring_of_experts=ring, moe_dropless_fallback="layer",
                   dropless_fallback_chunking=chunking, gmm_impl=gmm)
  params, x = skewed_inputs(config, BATCH, seq, skew=1.5, seed=shards + k)
  cot = jax.random.normal(jax.random.key(3), x.shape)
  run = lambda fn: jax.jit(functools.partial(outputs_and_grads, fn))(params, x, cot)

  y, stats, grads = run(_layer(config, mesh))
  y_ref, _, grads_ref = reference_outputs_and_grads(params, x, cot, k=k)
  assert int(stats.would_drop_rows) > 0, "the case must really overflow the capped buffer"
  assert int(stats.fallback) == 1 and int(stats.dropped_rows) == 0
  assert_trees_close(y, y_ref, what="y")
  assert_trees_close(grads, grads_ref, what="grad")

  # Control: the capped model without the fallback drops rows and diverges.
  y_cap, stats_cap, grads_cap = run(_layer(config.replace(moe_dropless_fallback="none"), mesh))
  assert int(stats_cap.dropped_rows) == int(stats.would_drop_rows)
  assert relative_error(y_cap, y_ref) > 1e-2
  assert relative_error(grads_cap[0].wo, grads_ref[0].wo) > 1e-2

  if "force_dropless" in extras:  # the worst-case buffer: dropless without a fallback
    y_force, stats_force, _ = run(_layer(config.replace(moe_dropless_fallback="none"), mesh,
                                         force_dropless=True))
    assert int(stats_force.dropped_rows) == 0 and int(stats_force.would_drop_rows) > 0
    assert_trees_close(y_force, y_ref, what="force_dropless y")
  if "step" in extras:
    step_config = config.replace(moe_dropless_fallback="step")
    y_step, stats_step, grads_step = run(_layer(step_config, mesh))
    assert int(stats_step.fallback) == 1 and int(stats_step.dropped_rows) == 0
    assert_trees_close(y_step, y_ref, what="step-mode y")
    assert_trees_close(grads_step, grads_ref, what="step-mode grad")


@pytest.mark.parametrize("ring", [False, True], ids=["all_to_all", "ring"])
def test_llama4_router_fallback_equals_dropless(ring):
  """Llama 4's router (sigmoid scores on the routed expert's input): an overflowing layer's
  fallback equals the dropless reference, outputs and every gradient; the capped layer drops
  rows and diverges."""
  shards, experts, k, factor, seq = OVERFLOW[2]
  mesh = moe_hk.make_mesh(data=NUM_DEVICES // shards, expert=shards)
  config = _config(experts, k, factor, use_ring_of_experts=ring, moe_dropless_fallback="layer",
                   dropless_fallback_chunking="fixed", router_score="sigmoid",
                   router_weights_on="input")
  params, x = skewed_inputs(config, BATCH, seq, skew=1.5, seed=shards + k)
  cot = jax.random.normal(jax.random.key(3), x.shape)
  run = lambda fn: jax.jit(functools.partial(outputs_and_grads, fn))(params, x, cot)
  y, stats, grads = run(_layer(config, mesh))
  y_ref, _, grads_ref = reference_outputs_and_grads(params, x, cot, k=k, score="sigmoid",
                                                    weights_on="input")
  assert int(stats.would_drop_rows) > 0 and int(stats.fallback) == 1
  assert int(stats.dropped_rows) == 0
  assert_trees_close(y, y_ref, what="y")
  assert_trees_close(grads, grads_ref, what="grad")
  y_cap, stats_cap, _ = run(_layer(config.replace(moe_dropless_fallback="none"), mesh))
  assert int(stats_cap.dropped_rows) > 0 and relative_error(y_cap, y_ref) > 1e-2


@pytest.mark.parametrize("ring", [pytest.param(False, marks=pytest.mark.slow), True],
                         ids=["all_to_all", "ring"])
def test_no_overflow_equals_model_without_fallback(ring):
  """Fixed chunking (adaptive's no-overflow case: tests/test_adaptive_fallback.py)."""
  mesh = moe_hk.make_mesh(data=2, expert=4)
  config = _config(8, 2, 2.0, use_ring_of_experts=ring, moe_dropless_fallback="layer",
                   dropless_fallback_chunking="fixed")
  params, x = skewed_inputs(config, BATCH, 16, skew=0.0, seed=11)  # balanced routing
  cot = jax.random.normal(jax.random.key(4), x.shape)
  run = lambda fn: jax.jit(functools.partial(outputs_and_grads, fn))(params, x, cot)
  y, stats, grads = run(_layer(config, mesh))
  y_plain, stats_plain, grads_plain = run(_layer(config.replace(moe_dropless_fallback="none"),
                                                 mesh))
  assert int(stats.would_drop_rows) == 0 and int(stats.fallback) == 0
  assert_trees_close((y, grads), (y_plain, grads_plain), rtol=1e-6, what="no overflow")
  assert_trees_close(stats, stats_plain, rtol=0, what="stats")


@pytest.mark.parametrize("ring", [False, True], ids=["all_to_all", "ring"])
def test_asymmetric_overflow_sets_flag_on_every_device(ring):
  """Only two devices' tokens are skewed, so only one expert group overflows; every device
  must take the fallback branch all the same. Fixed chunking (adaptive's asymmetric case:
  tests/test_adaptive_fallback.py)."""
  mesh = moe_hk.make_mesh(data=2, expert=4)
  config = _config(8, 2, 2.0, use_ring_of_experts=ring, moe_dropless_fallback="layer",
                   dropless_fallback_chunking="fixed")
  params, x = skewed_inputs(config, BATCH, 16, skew=6.0, seed=5, hot_rows=slice(0, 4))
  y, seen = per_device_stats(config, mesh, params, x, ("fallback", "would_drop_rows"))
  flags, would_drop = seen["fallback"], seen["would_drop_rows"]
  would_drop = np.asarray(would_drop).reshape(2, 4)
  assert would_drop[0].max() > 0 and would_drop[1].max() == 0, would_drop  # one group only
  np.testing.assert_array_equal(flags, 1)
  assert_trees_close(y, dense_reference(2)(params, x)[0], what="y")


def test_chunk_rule():
  # n >= min(P, E / K) / factor, smallest divisor of the sequence: 4 shards, 8 experts, top-2,
  # factor 0.5 -> n >= 8.
  kw = dict(batch=2, k=2, shards=4, local_experts=2)
  rows = int(2 * 16 * 2 * 0.5)
  assert fallback.fallback_num_chunks(seq=16, rows=rows, **kw) == 8
  assert fallback.fallback_num_chunks(seq=24, rows=int(2 * 24 * 2 * 0.5), **kw) == 8
  assert fallback.fallback_num_chunks(seq=24, rows=rows, **kw) == 12  # n >= 12 for 32 rows
  assert fallback.fallback_num_chunks(seq=20, rows=int(2 * 20 * 2 * 0.5), **kw) == 10
  assert fallback.fallback_num_chunks(seq=16, rows=rows, requested=16, **kw) == 16
  with pytest.raises(ValueError, match=r"dropless_fallback_num_chunks=3 must divide .* 16"):
    fallback.fallback_num_chunks(seq=16, rows=rows, requested=3, **kw)
  with pytest.raises(ValueError, match=r"dropless_fallback_num_chunks=4 .*= 64 rows\) fits .* 32"):
    fallback.fallback_num_chunks(seq=16, rows=rows, requested=4, **kw)


def test_infeasible_fallback_is_an_error_not_a_silent_drop():
  """8 shards, top-1, 8 experts, 16 tokens per shard, factor 0.25: 32 chunks of a 16-long
  sequence would be needed."""
  with pytest.raises(ValueError, match=r"holds 4 rows.* need 8 .* 2 x 16 chunks"):
    fallback.fallback_num_chunks(batch=1, seq=16, k=1, shards=8, local_experts=1, rows=4)
  mesh = moe_hk.make_mesh(expert=8)
  config = _config(8, 1, 0.25, moe_dropless_fallback="layer")
  params, x = skewed_inputs(config, 8, 16, skew=1.0)
  with pytest.raises(ValueError, match=r"no dropless fallback fits"):
    jax.jit(_layer(config, mesh))(params, x)


def test_chunks_are_contiguous_token_blocks():
  a = jnp.arange(2 * 12 * 3).reshape(2, 12, 3)
  chunks = fallback.token_chunks(a, 4)
  assert chunks.shape == (4, 6, 3)
  np.testing.assert_array_equal(chunks[2], a[1, :6])  # tokens 12..17 in (b, s) order
  seen = []
  def chunk_fn(x_c, y_c):
    seen.append(x_c.shape)
    return x_c * 2 + y_c
  out = fallback.chunked_dropless(chunk_fn, a, (a,), 4)
  np.testing.assert_array_equal(out, 3 * a)
  assert seen == [(6, 3)]  # traced once, inside the scan


def _scan_carries(jaxpr) -> list[tuple[tuple[int, ...], str]]:
  """(shape, dtype) of every scan carry in `jaxpr`, its sub-jaxprs included."""
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "scan":
      # A scan's outputs are its carries, shaped as its body's, then its stacked outputs,
      # each with a leading length (how jax 0.10 and 0.12 alike show which are which).
      body = eqn.params["jaxpr"].jaxpr
      for out, inner in zip(eqn.outvars, body.outvars):
        if out.aval.shape != inner.aval.shape:
          break
        found.append((tuple(out.aval.shape), str(out.aval.dtype)))
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      found += _scan_carries(sub)
  return found


@pytest.mark.parametrize("gathered_before", [False, True], ids=["product", "control"])
def test_chunks_sum_weight_gradients_as_the_experts_are_stored(gathered_before):
  """bfloat16 experts on an fsdp mesh: the fallback's chunk scan sums the weights' gradients
  in their stored form (float32, `[L, D / fsdp, F]`), each chunk's reduce-scattered, not in a
  carry of the gathered experts (`[L, D, F]` bfloat16, the sum rounded once per chunk,
  at fsdp times the size). The control gathers the experts before the layer's paths, as the
  layer did: its backward scan carries them gathered in bfloat16."""
  shards, fsdp = 4, 2
  mesh = moe_hk.make_mesh(data=1, fsdp=fsdp, expert=shards)
  config = _config(8, 2, 0.5, moe_dropless_fallback="layer", dtype="bfloat16")
  params, x = skewed_inputs(config, BATCH, 16, skew=1.5, seed=6)
  backends = mesh_forward.resolve_backends(config, mesh)

  def shard_fn(x_, router_w, wi_0, wi_1, wo):
    gather = functools.partial(mesh_forward.gather_experts, mesh=mesh, config=config)
    experts = ExpertWeights(wi_0, wi_1, wo)
    if gathered_before:
      experts, gather = gather(experts), shard_forward.as_stored
    shard = shard_forward.size(x_.shape, config, shards)
    return shard_forward.moe_shard(x_, router_w, experts, config=config, backends=backends,
                                   mesh_axes=tuple(mesh.axis_names), shard=shard,
                                   gather=gather)[0]
  batch = mesh_lib.batch_spec(mesh)
  layer = jax.shard_map(shard_fn, mesh=mesh, in_specs=(batch, *moe_hk.param_specs(config, mesh)),
                        out_specs=batch)
  loss = lambda p: jnp.sum(layer(x, *p))
  carries = _scan_carries(jax.make_jaxpr(jax.grad(loss))(params).jaxpr)
  local, width, hidden = 8 // shards, config.emb_dim, config.mlp_dim
  gathered = {((local, width, hidden), "bfloat16"), ((local, hidden, width), "bfloat16")}
  stored = {((local, width // fsdp, hidden), "float32"), ((local, hidden, width // fsdp), "float32")}
  if gathered_before:
    assert gathered <= set(carries), carries
  else:
    assert stored <= set(carries) and not gathered & set(carries), carries
