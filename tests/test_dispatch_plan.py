"""The dispatch plan (truncation, drop order, exchange arguments) against explicit loops."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_hk import dispatch_plan


def test_worked_example_from_the_docstring():
  traffic = jnp.array([[3, 2], [1, 3]])
  np.testing.assert_array_equal(dispatch_plan.truncate(traffic, 4), [[3, 2], [1, 2]])
  assert int(dispatch_plan.overflow_rows(traffic, 4)) == 1
  np.testing.assert_allclose(dispatch_plan.required_factor(traffic, 4), 5 / 4)


def _loop_plan(counts, shard, rows):
  """Exchange arguments and kept rows per (sender, expert), by walking rows one at a time."""
  num_shards, num_experts = counts.shape
  local = num_experts // num_shards
  kept = np.zeros_like(counts)
  for receiver in range(num_shards):
    budget = rows
    for sender in range(num_shards):
      for expert in range(receiver * local, (receiver + 1) * local):
        take = min(budget, counts[sender, expert])
        kept[sender, expert] = take
        budget -= take
  sent = kept.reshape(num_shards, num_shards, local).sum(-1)
  traffic = counts.reshape(num_shards, num_shards, local).sum(-1)
  input_offsets = [traffic[shard, :j].sum() for j in range(num_shards)]
  output_offsets = [sent[:shard, j].sum() for j in range(num_shards)]
  labels = []
  for sender in range(num_shards):
    for e in range(local):
      labels += [e] * kept[sender, shard * local + e]
  labels += [local] * (rows - len(labels))
  return dict(kept=kept, sent=sent, input_offsets=input_offsets, output_offsets=output_offsets,
              recv_sizes=sent[:, shard], labels=labels,
              group_sizes=kept[:, shard * local:(shard + 1) * local].sum(0))


@pytest.mark.parametrize("num_shards,local,rows,seed", [
    (2, 1, 5, 0), (4, 2, 9, 1), (8, 1, 12, 2), (4, 4, 40, 3), (8, 2, 3, 4), (2, 3, 1000, 5)])
def test_plan_matches_row_by_row_walk(num_shards, local, rows, seed):
  rng = np.random.default_rng(seed)
  # Skewed counts so that some receivers overflow and others do not.
  counts = rng.poisson(lam=rng.uniform(0.5, 6, size=num_shards * local),
                       size=(num_shards, num_shards * local)).astype(np.int32)
  sent = np.asarray(dispatch_plan.truncate(dispatch_plan.traffic_matrix(counts), rows))
  for shard in range(num_shards):
    want = _loop_plan(counts, shard, rows)
    plan = dispatch_plan.make_plan(jnp.asarray(counts), jnp.int32(shard), rows)
    np.testing.assert_array_equal(sent, want["sent"])
    np.testing.assert_array_equal(dispatch_plan.kept_per_expert(counts, sent), want["kept"])
    np.testing.assert_array_equal(plan.dispatch.input_offsets, want["input_offsets"])
    np.testing.assert_array_equal(plan.dispatch.send_sizes, want["sent"][shard])
    np.testing.assert_array_equal(plan.dispatch.output_offsets, want["output_offsets"])
    np.testing.assert_array_equal(plan.dispatch.recv_sizes, want["recv_sizes"])
    np.testing.assert_array_equal(plan.buffer_expert, want["labels"])
    np.testing.assert_array_equal(plan.local_group_sizes, want["group_sizes"])
    # The combine exchange is the dispatch run backwards.
    np.testing.assert_array_equal(plan.combine.send_sizes, want["recv_sizes"])
    np.testing.assert_array_equal(plan.combine.recv_sizes, want["sent"][shard])
    np.testing.assert_array_equal(
        plan.combine.input_offsets, [want["sent"][:i, shard].sum() for i in range(num_shards)])
    np.testing.assert_array_equal(
        plan.combine.output_offsets,
        [counts.reshape(num_shards, num_shards, local)[i, :shard].sum()
         for i in range(num_shards)])


def test_plan_is_jittable_with_traced_shard():
  counts = jnp.array([[4, 0, 1, 2], [0, 3, 3, 0]], jnp.int32)
  plans = jax.jit(jax.vmap(lambda s: dispatch_plan.make_plan(counts, s, 4)))(jnp.arange(2))
  np.testing.assert_array_equal(plans.dispatch.send_sizes, [[4, 3], [0, 1]])
