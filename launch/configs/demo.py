"""Demo (`python -m launch.demo`): one MoE layer, 16 experts top-2, a buffer of the balanced
rows."""
import ml_collections

from launch.configs import default


def get_config() -> ml_collections.ConfigDict:
  c = default.get_config()
  c.emb_dim = 64
  c.moe.update(num_experts=16, num_experts_per_tok=2, mlp_dim=128, ragged_buffer_factor=1.0)
  c.data.batch_size, c.data.seq_len = 16, 128
  return c
