"""Default: a small MoE transformer on Python stdlib bytes, 8 simulated CPU devices, minutes."""
import ml_collections


def _run(c: ml_collections.ConfigDict) -> None:
  """The mesh and the processes."""
  # Mesh: data x fsdp x expert must equal the device count (8 simulated CPU devices).
  c.mesh = ml_collections.ConfigDict(dict(data=1, fsdp=1, expert=8))
  # Simulated CPU devices when jax runs on the CPU (the machine has no TPU or GPU, or
  # JAX_PLATFORMS=cpu); the mesh must fit them. A --xla_force_host_platform_device_count in
  # XLA_FLAGS wins. Ignored on TPU/GPU.
  c.cpu_devices = 8
  # Multi-process runs: after this many seconds without a heartbeat from a process (killed, its
  # host lost) the others end the run in one line naming it and the newest checkpoint. jax's
  # default, 100 s, suits a TPU slice (a host busy compiling still sends heartbeats).
  c.heartbeat_timeout_s = 100


def _model(c: ml_collections.ConfigDict) -> None:
  """The transformer and its MoE layers."""
  c.vocab_size = 256          # bytes
  c.emb_dim = 128
  c.num_layers = 4
  c.moe_every = 2             # every 2nd block is MoE (Llama4 interleaving)
  c.num_heads = 4
  c.num_kv_heads = 2
  c.head_dim = 32
  c.mlp_dim = 256             # dense blocks' SwiGLU width
  c.dtype = "float32"         # compute dtype ('bfloat16' allowed); params stay float32
  # The knobs public checkpoints set (launch.convert, docs/checkpoints.md): False gives an
  # untied [V, D] output projection (True: the input embedding is the output projection); the
  # RoPE base (rotate-half layout); the RMSNorms' epsilon; True adds an RMSNorm over each query
  # and key head before the rotation (Qwen3). Initialisation (any width): the embeddings start
  # at scale 1/(2 sqrt(emb_dim)) (a normal cut at two scales) and the logits are not scaled,
  # so they start at standard deviation 0.44 and the first loss is about ln(vocab_size) + 0.1
  # (launch.model.transformer.embedding_init).
  c.tie_embeddings = True
  c.rope_theta = 10_000.0
  c.norm_eps = 1e-6
  c.qk_norm = False
  # What the backward keeps of each layer group's forward (launch.model.transformer.REMAT_POLICIES):
  # 'full' (everything recomputed, as large MoE models train), 'save_attention_moe' (keeps
  # the attention and MoE outputs), 'none' (no remat). The trainer's MoE telemetry comes from
  # the step's outputs under every policy; only the per-step host callbacks of capped-only
  # layers (stream_step_stats) are lost under 'none' (jax-ml/jax#28738).
  c.remat_policy = "full"
  # What one remat unit holds: 'group' (a layer group, one period of the layer pattern: the
  # backward recomputes its blocks together) or 'block' (each block of the group its own unit,
  # the scan still over groups: one block's activations alive in the backward at a time, and
  # an MoE block's forward is not recomputed for the blocks after it; every block's input is
  # kept, which 'full_inputs_on_host' keeps on the host). docs/aot-memory.md measures both.
  c.remat_unit = "group"
  # Layer groups per iteration of the scan over groups (1: a loop of one compiled group; the
  # number of groups or more: no loop, each group's weights sliced where they are read and its
  # gradients written in place; a larger program that compiles slower).
  c.layer_scan_unroll = 1
  # 'auto': splash attention (Pallas) on TPU, cuDNN on GPU, the XLA form on CPU; or name one.
  c.attention_impl = "auto"
  c.attention_block = 0       # query block of the XLA form's scan; 0 = whole sequence
  c.loss_chunk = 0            # positions per logits chunk of the loss scan; 0 = whole sequence
  _positions(c)
  _moe(c)


def _positions(c: ml_collections.ConfigDict) -> None:
  """How attention sees positions (launch.model.positions); the defaults are the plain
  model above, the other values Llama 4's."""
  # 'rotate_half' pairs dimension i with i + head_dim/2; 'interleaved' 2i with 2i + 1.
  c.rope_layout = "rotate_half"
  # type 'llama3': pairs whose wavelength exceeds original_max_positions / low_freq_factor
  # turn `factor` times slower, those below original_max_positions / high_freq_factor keep
  # their rate, those between blend the two; 'none': the plain rates.
  c.rope_scaling = ml_collections.ConfigDict(dict(
      type="none", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
      original_max_positions=8192))
  c.qk_l2_norm = False        # a weightless RMSNorm of each query and key head after the rotation
  # Every nope_every-th block (0: none) attends without rotary embeddings, over the whole
  # prefix; the others within chunks of attention_chunk_size positions (0: the whole prefix).
  c.nope_every = 0
  c.attention_chunk_size = 0
  # On those blocks, queries scaled by 1 + attn_scale x log(1 + floor((position + 1) /
  # floor_scale)) when attn_temperature_tuning.
  c.attn_temperature_tuning = False
  c.floor_scale = 8192.0
  c.attn_scale = 0.1


def _moe(c: ml_collections.ConfigDict) -> None:
  """The MoE layers."""
  # The MoE layers: every key is a `moe_hk.MoEConfig` field of the same name and meaning (its
  # width and dtype come from emb_dim and dtype above, record_traffic from traffic.record).
  c.moe = ml_collections.ConfigDict(dict(
      num_experts=8,
      num_experts_per_tok=2,
      mlp_dim=256,                      # each expert's SwiGLU width
      ragged_buffer_factor=2.0,         # receive buffer = factor x balanced rows; -1 worst case
      moe_dropless_fallback="layer",    # 'none' | 'layer' | 'step'
      # 'fixed': one compiled fallback branch, the quickest compile for this small CPU model;
      # 'adaptive' (MoEConfig's default): a ladder of branches sized from the step's traffic.
      dropless_fallback_chunking="fixed",
      dropless_fallback_num_chunks=0,   # 0 = the fewest whose worst case fits the buffer
      use_ring_of_experts=False,
      a2a_impl="auto",                  # 'native' (TPU/GPU) | 'emulated' (CPU) | by platform
      gmm_impl="auto",                  # 'ragged_dot' | 'blocked' | by platform
      gmm_block_rows=128,               # row tile of the 'blocked' grouped matmul
      router_score="softmax",           # or 'sigmoid' (Llama4 top-1)
      # softmax: True weighs the K chosen experts by the softmax over their logits (Mixtral);
      # False by their share of the softmax over all E (Qwen3-MoE's norm_topk_prob=False).
      norm_topk_prob=True,
      # 'output': each chosen expert's output is weighed by its router weight; 'input': the
      # weight scales the row the expert receives (Llama 4).
      router_weights_on="output",
      load_balance_loss_weight=0.01,
      router_z_loss_weight=1e-3,
      expert_axis="expert",             # the mesh axis experts are sharded over
      # The trainer takes every step's stats from the step itself; True also streams them
      # through host callbacks (for bare-layer users; costs a callback per layer and step).
      stream_step_stats=False,
      emit_fallback_events=True,        # a step that fell back calls back: alerts at once
  ))
  c.shared_expert = False     # a dense SwiGLU beside each MoE block's experts


def _telemetry(c: ml_collections.ConfigDict) -> None:
  """What the run records, the autopilot, the MoE metrics."""
  # The routed traffic, rows per (device, expert) and step: WORKDIR/traffic, for the planner
  # (`launch.capacity`); the directory keeps at most max_mib, newest first.
  c.traffic = ml_collections.ConfigDict(dict(record=True, max_mib=1024))
  # The factor rule's settings (docs/metrics.md; the alerts and the recommendation tag use
  # them whether or not the autopilot is on): the smallest factor (steps of 1/8) that would
  # have fallen back on at most target_fallback_frequency of the last `window` steps, unless a
  # smaller factor that falls back on at most max_fallback_frequency was measured (then the
  # fastest such, beyond the noise); nothing below min_steps steps of evidence. objective
  # 'fallback_frequency': the rule without the measured step times.
  # The autopilot (enabled; docs/autopilot.md) moves to the rule's factor after each full
  # window, and raises at once when the fallback ran on more than max_fallback_frequency of
  # the last window / 4 steps. Candidates compile in the background (at most max_programs);
  # any over memory_budget_gib (0: the device's memory on TPU/GPU, none on CPU) is refused.
  # wait: wait for a candidate's compile (a reproducible factor schedule).
  c.autopilot = ml_collections.ConfigDict(dict(
      enabled=False, objective="throughput", target_fallback_frequency=0.01,
      max_fallback_frequency=0.5, memory_budget_gib=0.0, window=100, min_steps=20,
      max_programs=8, wait=False))
  # MoE telemetry (TensorBoard tags, alerts); the training scalars are written either way.
  # False turns the layer's callbacks off too (moe.emit_fallback_events, moe.stream_step_stats).
  c.moe_metrics = True


def _training(c: ml_collections.ConfigDict) -> None:
  """Data, optimisation, skipped steps, evaluation, logging, checkpoints."""
  # Data: batches are a pure function of (seed, step), so resumption is exact.
  # source: 'stdlib' | 'synthetic' | 'files' (text files matching `pattern`, as bytes) |
  # 'array_record' (pre-tokenised int32 sequences in ArrayRecord files matching `pattern`).
  c.data = ml_collections.ConfigDict(dict(
      source="stdlib", pattern="", max_bytes=4_000_000, batch_size=16, seq_len=128, seed=0))
  # Optimisation: AdamW, linear warmup then cosine decay, global-norm clipping.
  c.learning_rate = 3e-3
  c.warmup_steps = 20
  c.train_steps = 200
  # The step the cosine decay reaches 0 at (the rate is 0 after it). 0: the run's first
  # start's train_steps, recorded in WORKDIR/config.json, so a resume with a raised train_steps
  # keeps the schedule; set it to re-plan the schedule of a run (the console says what changed).
  c.schedule_steps = 0
  c.weight_decay = 0.01
  c.grad_clip_norm = 1.0
  # dtype Adam's moments are stored in between steps ('float32' or 'bfloat16', as DeepSeek-V3
  # trains); the update itself runs in float32 either way.
  c.optimizer_state_dtype = "float32"
  c.seed = 0
  # A step whose loss or gradient norm is not finite changes nothing (params and optimizer
  # state kept, in the compiled step) and counts in train/skipped_steps; this many in a row
  # stop the run with a checkpoint of the last good state.
  c.skip_nonfinite_steps = True
  c.max_consecutive_nonfinite = 5
  # Loss and gradient-norm spikes (launch.model.spikes): with enabled, a step whose loss or
  # global gradient norm is more than `sigma` standard deviations above the mean of the last
  # `window` applied steps is skipped in the compiled step (params and optimizer state kept),
  # counted in train/spike_skipped_steps and alerted (loss_spike) with its data position.
  c.spikes = ml_collections.ConfigDict(dict(enabled=False, sigma=6.0, window=128))
  # Model FLOPs utilisation (train/mfu, the console's MFU): the chips' dense bf16 TFLOP/s;
  # 0 takes launch.run.throughput's table for the device kind (none on CPU).
  c.peak_tflops_per_device = 0.0
  # Evaluation, logging, checkpoints.
  c.eval_every = 50
  c.eval_batches = 2
  c.log_every = 10            # fetch the steps' outputs from the device every this many steps
  c.checkpoint_every = 50
  c.checkpoints_to_keep = 3


def get_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  _run(c)
  _model(c)
  _telemetry(c)
  _training(c)
  return c
