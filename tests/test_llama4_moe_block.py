"""Llama 4's MoE block in moe-hk against transformers' own: the sigmoid of each token's top-k
router logits scales the routed expert's input (`router_weights_on='input'`), and a shared
SwiGLU expert is added. Transformers recorded its first MoE block's input and output
(`moe_block.npz` beside each Llama 4 fixture, tests/fixtures/hf/make_fixtures.py); moe-hk runs
the block on that input with the checkpoint's weights, on 8 expert shards whose capped buffers
overflow. With the fallback the output is transformers' (float32, 1e-5); without, rows drop
and it is far off."""
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

import moe_hk
from tests.tree_close import assert_trees_close, relative_error

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "hf")
FACTOR = 1.0  # one balanced load per expert shard: the skewed router overflows it


def _block(folder: str):
  """(input, transformers' output, MoEParams, shared expert (gate, up, down) as x @ w)."""
  recorded = np.load(os.path.join(FIXTURES, folder, "moe_block.npz"))
  tensors = load_file(os.path.join(FIXTURES, folder, "model.safetensors"))
  suffix = f"layers.{int(recorded['layer'])}.feed_forward."
  [prefix] = {k[:k.index(suffix) + len(suffix)] for k in tensors if suffix in k}
  get = lambda name: jnp.asarray(tensors[prefix + name])
  gate_up, width = get("experts.gate_up_proj"), get("experts.down_proj").shape[1]  # [E, D, 2F]
  params = moe_hk.MoEParams(router_w=get("router.weight").T, wi_0=gate_up[..., :width],
                            wi_1=gate_up[..., width:], wo=get("experts.down_proj"))
  shared = tuple(get(f"shared_expert.{n}_proj.weight").T for n in ("gate", "up", "down"))
  return jnp.asarray(recorded["input"]), jnp.asarray(recorded["output"]), params, shared


def _forward(params, shared, x, *, fallback: str):
  experts, _, width = params.wi_0.shape
  config = moe_hk.MoEConfig(num_experts=experts, num_experts_per_tok=1, emb_dim=x.shape[-1],
                            mlp_dim=width, ragged_buffer_factor=FACTOR,
                            moe_dropless_fallback=fallback, dropless_fallback_chunking="fixed",
                            router_score="sigmoid", router_weights_on="input",
                            gmm_impl="ragged_dot", load_balance_loss_weight=0.0)
  y, stats = moe_hk.moe_forward(params, x, config=config, mesh=moe_hk.make_mesh(expert=8))
  gate, up, down = shared
  return y + (jax.nn.silu(x @ gate) * (x @ up)) @ down, stats


@pytest.mark.parametrize("folder", ["llama4_text", "llama4_text_v4", "llama4"])
def test_the_moe_block_equals_transformers_when_it_overflows(folder):
  x, expected, params, shared = _block(folder)
  run = jax.jit(functools.partial(_forward, fallback="layer"))
  y, stats = run(params, shared, x)
  assert int(stats.would_drop_rows) > 0, "the skewed router must overflow the capped buffers"
  assert int(stats.fallback) == 1 and int(stats.dropped_rows) == 0
  assert_trees_close(y, expected, what=f"{folder} MoE block")
  capped, capped_stats = jax.jit(functools.partial(_forward, fallback="none"))(params, shared, x)
  assert int(capped_stats.dropped_rows) > 0
  assert relative_error(capped, expected) > 1e-2
