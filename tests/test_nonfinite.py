"""Non-finite router input is not overflow: a token whose router logits are NaN or inf goes to
no expert, so it raises no required factor, overflows no buffer and starts no fallback; its
output row is NaN, and the finite tokens' outputs and gradients are the dense reference's on
the finite tokens alone. Both paths, every fallback mode, capped, worst case and chunked."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moe_hk
from metrics import Aggregator, AlertManager, layer_record
from tests import reference
from tests.moe_inputs import outputs_and_grads, reference_outputs_and_grads, skewed_inputs
from tests.tree_close import assert_trees_close

MESH = dict(data=2, expert=4)
NUM_DEVICES, SHARDS, EXPERTS, K = 8, 4, 8, 2
BATCH, SEQ = 16, 8             # 16 tokens, N = 32 rows per device
FACTOR = 1.5                   # R = 48 rows: the finite tokens' traffic fits
BASE = dict(num_experts=EXPERTS, num_experts_per_tok=K, emb_dim=16, mlp_dim=32,
            gmm_block_rows=8, router_z_loss_weight=1e-3, record_traffic=True)
# The all-to-all path's compiled cases are marked slow: `make test-fast` runs the ring's.
PATHS = pytest.mark.parametrize("ring", [pytest.param(False, marks=pytest.mark.slow), True],
                                ids=["all_to_all", "ring"])


def _inputs():
  """`MoEParams`, x `[B, S, D]` with NaN and inf tokens, and which tokens are non-finite
  `[B, S]`. Device d holds batch rows 2d and 2d + 1; devices 0-3 are one expert group."""
  params, x = skewed_inputs(moe_hk.MoEConfig(**BASE), BATCH, SEQ, skew=0.0, seed=0)
  x = np.array(x)
  x[0, :6] = np.nan          # device 0
  x[2, 1:5] = np.nan         # device 1
  x[5, 3:7, 0] = np.inf      # device 2: one component of each token
  x[9, 1:5] = -np.inf        # device 4, the other expert group
  # A finite token whose logit for expert 0 overflows float32 to inf.
  x[14, 2] = 3e38 * np.sign(np.asarray(params.router_w[:, 0]))
  nonfinite = ~np.isfinite(x).all(axis=-1)
  nonfinite[14, 2] = True
  return params, jnp.asarray(x), nonfinite


def _counts(ids, routed) -> np.ndarray:
  """`[devices, E]` rows each device routes to each expert, tokens `routed [B, S]` only."""
  ids = np.asarray(ids).reshape(NUM_DEVICES, -1, K)
  routed = np.asarray(routed).reshape(NUM_DEVICES, -1)
  return np.stack([np.bincount(i[r].reshape(-1), minlength=EXPERTS) for i, r in zip(ids, routed)])


def _received_factor(ids, routed) -> float:
  """Required factor of routing `ids [B, S, K]` counting only tokens `routed [B, S]`: the
  busiest receiver's rows over N, receivers summed over their group's senders."""
  counts = _counts(ids, routed).reshape(NUM_DEVICES // SHARDS, SHARDS, SHARDS, -1)
  return counts.sum(axis=(1, 3)).max() / (BATCH * SEQ // NUM_DEVICES * K)


def _router_stats(logits, ids, routed) -> tuple[float, float, float]:
  """(lb_loss, z_loss, router_entropy) over the routed tokens, per device then averaged,
  weighted as `BASE` and the defaults weight them."""
  per_device = lambda a: np.asarray(a).reshape(NUM_DEVICES, -1, *np.shape(a)[2:])
  lb, z, entropy = [], [], []
  for lg, i, r in zip(per_device(logits).astype(np.float64), per_device(ids), per_device(routed)):
    lg, i = lg[r], i[r]
    probs = np.exp(lg - lg.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    fraction = np.bincount(i.reshape(-1), minlength=EXPERTS) / i.size
    lb.append(EXPERTS * np.sum(fraction * probs.mean(0)))
    z.append(np.mean(np.log(np.exp(lg).sum(-1)) ** 2))
    entropy.append(np.mean(-np.sum(probs * np.log(probs), axis=-1)))
  return np.mean(lb) * 0.01, np.mean(z) * 1e-3, np.mean(entropy)


@functools.lru_cache(maxsize=None)
def _expected():
  """The inputs, the cotangent (0 on non-finite rows) and the dense reference on the finite
  tokens alone: non-finite tokens zeroed in x and kept out of every expert."""
  params, x, nonfinite = _inputs()
  routed = ~nonfinite
  x_ref = jnp.where(routed[..., None], x, 0)
  cot = jax.random.normal(jax.random.key(5), x.shape) * routed[..., None]
  ids, _, logits = reference.reference_routing(params.router_w, x_ref, K, "softmax")
  keep = jnp.broadcast_to(jnp.asarray(routed, jnp.float32)[..., None], ids.shape)
  y_ref, _, grads_ref = reference_outputs_and_grads(params, x_ref, cot, keep, k=K)
  return dict(params=params, x=x, nonfinite=nonfinite, cot=cot, y_ref=y_ref,
              grads_ref=grads_ref, counts=_counts(ids, routed),
              required=_received_factor(ids, routed),
              router_stats=_router_stats(logits, ids, routed))


def _check(y, stats, *, fell_back: bool, overflowed: bool = False):
  """NaN rows exactly at the non-finite tokens, the other rows the reference's, and stats
  that count the non-finite tokens and nothing else of theirs (`overflowed`: the finite
  tokens' own traffic overflows the buffer, and the fallback dropped none of it)."""
  e = _expected()
  nonfinite = e["nonfinite"]
  y = np.asarray(y)
  np.testing.assert_array_equal(np.isnan(y).any(axis=-1), nonfinite)
  assert np.isnan(y[nonfinite]).all()
  assert_trees_close(y[~nonfinite], np.asarray(e["y_ref"])[~nonfinite], what="finite rows")
  assert int(stats.nonfinite_tokens) == nonfinite.sum() == 19
  assert int(stats.fallback) == fell_back and (int(stats.fallback_chunks) > 0) == fell_back
  assert int(stats.dropped_rows) == 0 and (int(stats.would_drop_rows) > 0) == overflowed
  assert (np.asarray(stats.receiver_overflow_rows) > 0).any() == overflowed
  np.testing.assert_allclose(stats.required_factor, e["required"], rtol=1e-6)
  np.testing.assert_array_equal(stats.tokens_per_expert, e["counts"].sum(axis=0))
  np.testing.assert_array_equal(stats.routed_rows_per_device, e["counts"])
  np.testing.assert_allclose((stats.lb_loss, stats.z_loss, stats.router_entropy),
                             e["router_stats"], rtol=1e-5)


# Mode and buffer, and the values of step mode's after_overflow flag to run (traced: one
# compile; the other modes' runs take no flag and fall back where it is True). Step mode's
# flag False runs the capped path behind the overflow check (as 'layer' does when nothing
# overflows), True the chunked dropless path. At factor 1.0 (R = 32 rows) the finite tokens'
# own traffic (required 1.34) overflows: 'layer' runs its fallback, in 4 chunks (a chunk's
# worst case 4 x 4 x 2 = 32 rows) or on the adaptive ladder.
CASES = {
    "none_worst_case": (dict(moe_dropless_fallback="none", ragged_buffer_factor=-1), (False,)),
    "none_capped": (dict(moe_dropless_fallback="none", ragged_buffer_factor=FACTOR), (False,)),
    "step_fixed": (dict(moe_dropless_fallback="step", dropless_fallback_chunking="fixed",
                        ragged_buffer_factor=FACTOR), (False, True)),
    "layer_fixed": (dict(moe_dropless_fallback="layer", dropless_fallback_chunking="fixed",
                         ragged_buffer_factor=1.0), (True,)),
    "layer_adaptive": (dict(moe_dropless_fallback="layer", dropless_fallback_chunking="adaptive",
                            ragged_buffer_factor=1.0), (True,)),
}


@PATHS
@pytest.mark.parametrize("case", list(CASES))
def test_nonfinite_tokens_go_to_no_expert(ring, case):
  """Outputs, every gradient (a cotangent that is 0 on the non-finite rows) and stats."""
  overrides, flags = CASES[case]
  config = moe_hk.MoEConfig(**BASE, **overrides, use_ring_of_experts=ring)
  mesh = moe_hk.make_mesh(**MESH)
  step_mode = config.step_fallback

  @jax.jit
  def run(params, x, cot, flag):
    layer = functools.partial(moe_hk.moe_forward, config=config, mesh=mesh,
                              after_overflow=flag if step_mode else None)
    return outputs_and_grads(layer, params, x, cot)

  e = _expected()
  overflowed = config.layer_fallback
  assert not overflowed or e["required"] > config.ragged_buffer_factor
  for flag in flags:
    y, stats, grads = run(e["params"], e["x"], e["cot"], flag)
    _check(y, stats, fell_back=flag, overflowed=overflowed)
    assert_trees_close(grads, e["grads_ref"], what=f"grad (after_overflow={flag})")


def test_default_layer_mode_neither_falls_back_nor_blames_an_expert():
  """The default ('layer', adaptive chunking) with a capped buffer: no fallback and one
  `nonfinite_router_input` alert. Control: had the non-finite tokens been routed by their
  logits (top-k of NaN picks experts 0 and 1, as the router did before), the buffer would
  have overflowed. The all-to-all path (the ring's routing of these tokens is the same, and
  its capped and chunked paths are checked above)."""
  e = _expected()
  config = moe_hk.MoEConfig(**BASE, ragged_buffer_factor=FACTOR)
  assert config.layer_fallback
  y, stats = jax.jit(functools.partial(moe_hk.moe_forward, config=config,
                                       mesh=moe_hk.make_mesh(**MESH)))(e["params"], e["x"])
  _check(y, stats, fell_back=False)

  logits = jnp.einsum("bsd,de->bse", e["x"], e["params"].router_w)
  assert np.isfinite(e["x"][14, 2]).all() and not np.isfinite(logits[14, 2]).all()
  old_ids = jax.lax.top_k(logits, K)[1]
  old_factor = _received_factor(old_ids, np.ones((BATCH, SEQ), bool))
  assert e["required"] <= FACTOR < old_factor, (e["required"], old_factor)

  aggregator = Aggregator()
  aggregator.add(0, 0, layer_record(stats, process=0))
  alerts = AlertManager(worst_case_factor=min(SHARDS, EXPERTS / K)).check(
      aggregator.finish_step(0))
  assert [a.rule for a in alerts] == ["nonfinite_router_input"]
  assert alerts[0].details["nonfinite_tokens"] == [19] and alerts[0].details["hotspots"] == []
