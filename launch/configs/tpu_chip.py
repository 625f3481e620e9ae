"""One TPU chip of 16 GiB (a v5e): a ~0.7B-parameter MoE transformer that fills it.

`python -m launch.train --workdir=W --config=launch/configs/tpu_chip.py` on a single TPU host
with one chip; `python -m launch.aot --config=launch/configs/tpu_chip.py
--compile_topology=v5e:1x1` compiles it for one from any machine (docs/tpu-chip.md).

Width 2048, 6 layers alternating dense and MoE (8 experts top-2, expert MLP 2816, dense MLP
5632), 16 query / 8 key-value heads of 128, vocabulary 32768, 8 sequences of 2048 a step,
bfloat16 compute on float32 parameters, Adam moments in bfloat16, synthetic tokens (the chip
machines have no data sets; `data.source='array_record'` with `data.pattern` trains on files).
One chip is one expert shard: the receive buffer of 1.0 x the balanced rows holds every row
(with one shard the worst case is the balanced load), so nothing overflows and no fallback is
built; a factor below 1 (e.g. `--config.moe.ragged_buffer_factor=0.75`) makes every MoE layer
overflow on every step, to measure the fallback.
"""
import ml_collections

from launch.configs import default


def get_config() -> ml_collections.ConfigDict:
  c = default.get_config()
  c.mesh = ml_collections.ConfigDict(dict(data=1, fsdp=1, expert=1))
  # Initialisation (launch.model.transformer.embedding_init): the embedding's scale is
  # 1/(2 sqrt(emb_dim)) and the logits are not scaled, so the first loss is about ln(32768) +
  # 0.1 = 10.5 nats at this width (an embedding of unit deviation, logits over sqrt(emb_dim): 27).
  c.vocab_size = 32_768
  c.emb_dim = 2048
  c.num_layers = 6
  c.moe_every = 2
  c.num_heads, c.num_kv_heads, c.head_dim = 16, 8, 128
  c.mlp_dim = 5632
  c.dtype = "bfloat16"
  c.optimizer_state_dtype = "bfloat16"
  # Each group recomputed in the backward but for its matmuls' outputs (projections, experts)
  # and splash's residuals, and the three groups unrolled (no scan): 0.417 s a step against
  # 0.445 with 'save_dots' in a scan, holding 13.1 GiB of the chip's 15.75 as that did
  # (docs/tpu-chip.md).
  c.remat_policy = "save_matmuls"
  c.layer_scan_unroll = 3
  c.attention_impl = "auto"   # splash attention on TPU (the XLA form elsewhere)
  c.loss_chunk = 1024         # a [8, 1024, 32768] float32 logits block (1 GiB) at a time: 0.410
                              # s a step against 0.4165 in chunks of 512 (docs/tpu-chip.md)
  # Below factor 1 the fallback runs in 8 chunks, not the fewest that fit (2): compiled for
  # v5e at factor 0.75 the step then needs 1.04x the capped step's memory instead of 1.10x
  # (16 and 32 chunks: the same; docs/tpu-chip.md).
  c.moe.update(num_experts=8, num_experts_per_tok=2, mlp_dim=2816, ragged_buffer_factor=1.0,
               dropless_fallback_num_chunks=8,
               gmm_impl="auto")  # XLA's ragged_dot on TPU (docs/tpu-chip.md)
  c.data.update(source="synthetic", batch_size=8, seq_len=2048)
  c.learning_rate = 3e-4
  c.warmup_steps = 100
  c.train_steps = 300
  c.log_every = 10
  c.eval_every = 100
  c.checkpoint_every = 100
  return c
