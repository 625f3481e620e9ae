"""Tiny: the default model shrunk to seconds per step (tests, smoke runs); overflows often."""
import ml_collections

from launch.configs import default


def get_config() -> ml_collections.ConfigDict:
  c = default.get_config()
  c.emb_dim, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim = 32, 2, 2, 1, 16
  c.mlp_dim = c.moe.mlp_dim = 64
  c.data.batch_size, c.data.seq_len, c.data.max_bytes = 8, 32, 200_000
  c.train_steps, c.warmup_steps, c.eval_every, c.checkpoint_every = 8, 2, 4, 4
  c.attention_impl = "xla"  # splash tiles are >= 128 positions, longer than its sequence
  c.moe.ragged_buffer_factor = 1.0  # below the untrained router's needs: the fallback runs
  return c
