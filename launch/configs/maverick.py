"""Llama 4 Maverick (the text model of meta-llama/Llama-4-Maverick-17B-128E) on a v5p-256
slice: trained by `launch.train` on ArrayRecord token files (`launch.prepare_data`), compiled
ahead by `launch.aot` from the same file (docs/tpu-pod.md).

The published architecture, what it computes included (the `text_config` of its config.json;
`launch.convert --from_hf` of that checkpoint gives the same keys): 48 layers alternating dense
and MoE (128 experts, top-1 with the sigmoid of the chosen logit scaling the expert's input,
plus a shared expert), width 5120, MoE MLP 8192, dense MLP 16384, 40 query heads / 8 KV heads
of 128, vocabulary 202,048, untied output; every 4th layer without RoPE (whole prefix,
temperature-tuned queries), the others with interleaved RoPE of base 500,000 within chunks of
8,192 positions; no query/key norm, no RoPE scaling; RMSNorm epsilon 1e-5.

bfloat16 compute on float32 params + Adam, every block rematerialised on its own (a remat unit
per block, 4 to a layer group: one period of the pattern, 2 dense and 2 MoE layers) with its
input in host memory. Mesh FSDP 8 x EP 16 (v5p-256: 128 chips), 4 sequences of 8,192 per chip,
buffer factor 2.0, 32 fallback chunks. AdamW at a peak learning rate of 2.2e-4 after 2,000
warmup steps, weight decay 0.1 (DeepSeek-V3's schedule for its 671B MoE), loss and gradient-norm
spikes skipped.
"""
import ml_collections

from launch.configs import default


def _llama4_attention(c: ml_collections.ConfigDict) -> None:
  """Llama 4's positions (launch.model.positions): every 4th block without RoPE, over the
  whole prefix with temperature-tuned queries (floor_scale 8192, attn_scale 0.1); the others
  with interleaved RoPE of base 500,000 within chunks of 8,192 positions (the whole sequence
  at seq_len 8192)."""
  c.rope_theta = 500_000.0
  c.rope_layout = "interleaved"
  c.nope_every = 4
  c.attention_chunk_size = 8192
  c.attn_temperature_tuning = True
  c.floor_scale, c.attn_scale = 8192.0, 0.1


def get_config() -> ml_collections.ConfigDict:
  c = default.get_config()
  c.mesh = ml_collections.ConfigDict(dict(data=1, fsdp=8, expert=16))
  c.vocab_size = 202_048
  c.emb_dim = 5120
  c.num_layers = 48
  c.moe_every = 2
  c.num_heads, c.num_kv_heads, c.head_dim = 40, 8, 128
  c.mlp_dim = 16_384
  c.tie_embeddings = False
  c.norm_eps = 1e-5
  _llama4_attention(c)
  c.dtype = "bfloat16"
  # Every block recomputed in the backward on its own, its input kept in the host's memory
  # (48 x [4, 8192, 5120] bfloat16 per chip, 15 GiB). Against the whole layer group as one
  # unit (v5p-256, docs/aot-memory.md, 1e5ca3d): 68.21 GiB per chip capped, not 84.61, 4.7%
  # fewer matmul FLOPs (the last matmul of each block is no longer recomputed), and the
  # fallback's FLOPs the capped step's (the group unit ran its first MoE block's forward again
  # in the fallback's backward: +2.7%); Scout's: 11% fewer at +0.35 GiB.
  c.remat_policy = "full_inputs_on_host"
  c.remat_unit = "block"
  c.optimizer_state_dtype = "bfloat16"  # Adam moments in bf16 (docs/aot-memory.md)
  c.attention_impl = "auto"  # splash attention on TPU
  c.attention_block = 512    # with attention_impl='xla': a [4, 40, 512, 8192] f32 score block
  c.loss_chunk = 512        # a [4, 512, 202048] float32 logits block at a time
  c.moe.update(num_experts=128, num_experts_per_tok=1, mlp_dim=8192, ragged_buffer_factor=2.0,
               router_score="sigmoid", router_weights_on="input")
  c.shared_expert = True
  # 32 fallback chunks of 1,024 tokens (a chunk's worst case is 1/4 of the capped buffer)
  # rather than the fewest that fit (8, each the capped buffer's size): the TPU compiler does
  # not overlap the chunk's buffers with the capped path's, so smaller chunks cost less on top
  # of the capped step (docs/aot-memory.md, 'What sets it').
  c.moe.dropless_fallback_num_chunks = 32
  # jax's Pallas TPU grouped matmul: its backward reads the experts' weights transposed in
  # place, where XLA's ragged_dot copied all three [8, 5120, 8192] stacks into another layout
  # in every chunk of the fallback's backward (docs/aot-memory.md).
  c.moe.gmm_impl = "megablox"
  # 4.19M tokens a step. The token files: `--config.data.pattern=GLOB` on every host
  # (launch.prepare_data writes them with the model's tokenizer: 202,048 ids).
  c.data.update(source="array_record", pattern="", batch_size=4 * 128, seq_len=8192)
  c.learning_rate = 2.2e-4
  c.warmup_steps = 2000
  c.train_steps = 250_000   # about 1T tokens: set it from the run's token budget
  c.weight_decay = 0.1
  c.grad_clip_norm = 1.0
  c.spikes.enabled = True
  c.log_every = 10
  c.eval_every = 1000
  c.eval_batches = 4
  c.checkpoint_every = 100  # ~45 min at 40% MFU (27 s a step): what a preemption can lose
  c.checkpoints_to_keep = 3
  return c
