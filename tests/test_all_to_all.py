"""The emulated ragged all-to-all against the semantics documented for jax.lax.ragged_all_to_all."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from moe_hk.all_to_all import emulated_ragged_all_to_all, ragged_all_to_all
from moe_hk.dispatch_plan import Exchange


def _run_emulated(operands, outputs, exchanges):
  """Runs the emulation on len(operands) devices; per-device inputs stacked on axis 0."""
  shards = len(operands)
  mesh = Mesh(np.asarray(jax.devices()[:shards]), ("x",))
  def per_shard(op, out, *ex):
    ex = Exchange(*(e[0] for e in ex))
    return emulated_ragged_all_to_all(op[0], out[0], ex, "x")[None]
  fn = jax.shard_map(per_shard, mesh=mesh, in_specs=P("x"), out_specs=P("x"))
  stacked = [jnp.asarray(np.stack(a)) for a in (operands, outputs, *zip(*exchanges))]
  return jax.jit(fn)(*stacked), (mesh, fn, stacked)


def _model(operands, outputs, exchanges):
  """Numpy transcription of the documented SEND / RECEIVE pseudocode."""
  result = [np.array(o) for o in outputs]
  for sender, ex in enumerate(exchanges):
    for receiver in range(len(operands)):
      n = ex.send_sizes[receiver]
      start, dest = ex.input_offsets[receiver], ex.output_offsets[receiver]
      result[receiver][dest:dest + n] = operands[sender][start:start + n]
  return np.stack(result)


def test_documented_two_device_example():
  operands = [np.array([1., 2, 2]), np.array([3., 4, 0])]
  outputs = [np.zeros(4), np.zeros(4)]
  exchanges = [Exchange(np.array([0, 1]), np.array([1, 2]), np.array([0, 0]), np.array([1, 1])),
               Exchange(np.array([0, 1]), np.array([1, 1]), np.array([1, 2]), np.array([2, 1]))]
  result, _ = _run_emulated(operands, outputs, exchanges)
  np.testing.assert_array_equal(result, [[1, 3, 0, 0], [2, 2, 4, 0]])


def _place(sizes, total, rng):
  """Offsets of segments `sizes` in a buffer of `total` rows: random order, random gaps."""
  offsets, pos, slack = np.zeros_like(sizes), 0, total - sizes.sum()
  for j in rng.permutation(len(sizes)):
    gap = rng.integers(0, slack + 1)
    slack, pos = slack - gap, pos + gap
    offsets[j], pos = pos, pos + sizes[j]
  return offsets


def _random_exchanges(rng, shards, in_rows, out_rows):
  """One `Exchange` per shard with consistent sizes and non-overlapping segments."""
  while True:
    sizes = rng.integers(0, 5, size=(shards, shards))  # [sender, receiver]
    if sizes.sum(1).max() <= in_rows and sizes.sum(0).max() <= out_rows:
      break
  input_offsets = np.stack([_place(sizes[i], in_rows, rng) for i in range(shards)])
  output_offsets = np.stack([_place(sizes[:, j], out_rows, rng) for j in range(shards)], 1)
  return [Exchange(input_offsets[i], sizes[i], output_offsets[i], sizes[:, i])
          for i in range(shards)]


@pytest.mark.parametrize("shards,in_rows,out_rows,seed", [
    (2, 6, 9, 0), (4, 12, 10, 1), (8, 20, 24, 2), (8, 30, 12, 3), (1, 4, 6, 4)])
def test_random_exchanges_match_documented_semantics(shards, in_rows, out_rows, seed):
  rng = np.random.default_rng(seed)
  exchanges = _random_exchanges(rng, shards, in_rows, out_rows)
  operands = [rng.normal(size=(in_rows, 3)).astype(np.float32) for _ in range(shards)]
  outputs = [rng.normal(size=(out_rows, 3)).astype(np.float32) for _ in range(shards)]
  result, (mesh, fn, stacked) = _run_emulated(operands, outputs, exchanges)
  np.testing.assert_array_equal(result, _model(operands, outputs, exchanges))

  # The exchange is linear in (operand, output): its VJP is the model's transpose, which we get
  # by pushing one-hot rows through the numpy model.
  cot = rng.normal(size=np.shape(result)).astype(np.float32)
  d_operand, d_output = jax.vjp(lambda a, b: jax.jit(fn)(a, b, *stacked[2:]),
                                stacked[0], stacked[1])[1](jnp.asarray(cot))
  basis = np.eye(in_rows * 3, dtype=np.float32).reshape(-1, in_rows, 3)
  zeros_out = [np.zeros((out_rows, 3), np.float32)] * shards
  want = np.zeros((shards, in_rows, 3), np.float32)
  for s in range(shards):
    for b in basis:
      ops = [b if t == s else np.zeros_like(b) for t in range(shards)]
      want[s] += np.sum(_model(ops, zeros_out, exchanges) * cot) * b
  np.testing.assert_allclose(d_operand, want, rtol=1e-6, atol=1e-6)
  untouched = _model([np.zeros((in_rows, 3))] * shards, [np.ones((out_rows, 3))] * shards,
                     exchanges)
  np.testing.assert_allclose(d_output, cot * untouched, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("in_rows,out_rows,sent", [(6, 4, 3), (6, 4, 4), (3, 5, 2), (4, 4, 0)])
def test_one_shard_exchange_copies_its_segment(in_rows, out_rows, sent):
  """On an axis of one shard the exchange is `local_ragged_all_to_all`'s copy (what a
  plan for one shard asks: offsets 0), against the documented semantics; rows past the
  segment keep the output's values."""
  rng = np.random.default_rng(sent)
  operand, output = (rng.normal(size=(n, 2)).astype(np.float32) for n in (in_rows, out_rows))
  exchange = Exchange(np.array([0]), np.array([sent]), np.array([0]), np.array([sent]))
  mesh = Mesh(np.asarray(jax.devices()[:1]), ("x",))
  copy = jax.shard_map(lambda op, out: ragged_all_to_all(op, out, exchange, "x", "emulated"),
                       mesh=mesh, in_specs=P(), out_specs=P())
  np.testing.assert_array_equal(jax.jit(copy)(operand, output),
                                _model([operand], [output], [exchange])[0])
