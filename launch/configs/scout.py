"""Llama 4 Scout (the text model of meta-llama/Llama-4-Scout-17B-16E) on a v5p-256 slice,
trained and compiled ahead as `maverick.py` is (docs/tpu-pod.md).

The published architecture (the `text_config` of its config.json; `launch.convert --from_hf`
of that checkpoint gives the same keys): Maverick's but for every layer being MoE (16
experts, top-1, a shared expert), query/key L2 norm on the RoPE layers, and llama3 RoPE
scaling (factor 16, low and high frequency factors 1, original 8,192 positions). 48 MoE
layers of which every 4th without RoPE: a layer group holds 4.

Mesh, batch, precision, remat, optimiser and schedule are Maverick's: FSDP 8 x EP 16 (one
expert per expert shard), 4 sequences of 8,192 per chip.
"""
import ml_collections

from launch.configs import maverick


def get_config() -> ml_collections.ConfigDict:
  c = maverick.get_config()
  c.moe_every = 1
  c.qk_l2_norm = True
  c.rope_scaling.update(type="llama3", factor=16.0, low_freq_factor=1.0, high_freq_factor=1.0,
                        original_max_positions=8192)
  c.moe.num_experts = 16
  return c
