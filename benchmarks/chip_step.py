"""The launcher's train step on the chip that is present: speed per attention form and grouped
matmul backend, and peak memory per MoE buffer variant.

  python -m benchmarks.chip_step [--config=launch/configs/tpu_chip.py] [--steps=10]
      [--attention=auto] [--gmm=ragged_dot,megablox] [--memory=capped,fallback,worst_case]
      [--profile_dir=DIR] [--results=chip_step] [--config.KEY=VALUE ...]

Each case runs in a process of its own, so that the device's `peak_bytes_in_use` is that one
program's: the train step of `launch.model.train_step.make_steps` (what `launch.train` runs),
compiled ahead of time first (its `memory_analysis()`, what `launch.aot`'s table reports) and
then run `--warmup` steps plus `--steps` timed ones on synthetic tokens. Speed: tokens/s, model
TFLOP/s per chip and MFU as the trainer counts them (`launch.run.throughput`: 6 x active
parameters x tokens plus attention, no remat recompute, over the chip's dense bf16 peak).
Memory cases set the MoE buffer: `capped` (factor 0.75 without a fallback: drops rows),
`fallback` (0.75 with the layer fallback: every MoE layer of every step overflows and runs
dropless in chunks), `worst_case` (factor -1), each with the config's attention and backend.
`--profile_dir` writes a `jax.profiler` trace of the timed steps of every case.

Writes `benchmarks/results/<--results>.json` (chip kind, jax version, commit, command) and a
table. On a machine without an accelerator it runs on the CPU (no MFU, no peak memory): a
check of the script, e.g. `--config=launch/configs/tiny.py --attention=xla --gmm=ragged_dot`.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from launch.setup import platform, results, settings as settings_lib

# Memory cases: the MoE layers' overrides (the factor below 1 overflows even one expert
# shard, whose worst case is its balanced load).
MEMORY_CASES = {
    "capped": {"moe.ragged_buffer_factor": 0.75, "moe.moe_dropless_fallback": "none"},
    "fallback": {"moe.ragged_buffer_factor": 0.75, "moe.moe_dropless_fallback": "layer"},
    "worst_case": {"moe.ragged_buffer_factor": -1.0},
}


def largest_ballast(compiled, init, batch, limit: int, resolution: int = 64 << 20,
                    guess: int | None = None) -> int:
  """The most bytes a ballast array can hold on the device while `compiled` still runs a
  step of a fresh state (`init()`) on `batch`, to `resolution`: the device's limit less this
  is what the step needs there, state, temporaries and the allocator's fragmentation
  together, whatever its statistics count.

  Every answer is a step that ran or ran out of memory: `guess` (bytes, e.g. the limit less
  what the statistics say the step holds) only says where to try first. From there the
  strides double until the boundary is bracketed, then halve: two or three tries when the
  guess is the answer (each try is a fresh state and a step, seconds on the chip), about
  twice log2 of its error in units of `resolution` otherwise; without one, a bisection of
  `[0, limit]` (log2 of limit / resolution tries, 8 on a 16 GiB chip)."""
  import jax
  import jax.numpy as jnp

  def runs_beside(units: int) -> bool:
    state = init()
    try:
      ballast = jnp.zeros((units * resolution,), jnp.uint8)
      jax.block_until_ready(compiled(state, batch))
      return True
    except jax.errors.JaxRuntimeError as e:
      if "RESOURCE_EXHAUSTED" not in str(e):
        raise
      return False
    finally:
      ballast = state = None  # noqa: F841  (frees both before the next try)

  fits, too_big = 0, limit // resolution + 1  # in units of `resolution`: 0 always fits
  if guess is not None:
    first, stride = min(max(guess // resolution, 0), too_big - 1), 1
    if first == 0 or runs_beside(first):
      fits = first
      while fits + stride < too_big and runs_beside(fits + stride):
        fits, stride = fits + stride, stride * 2
      too_big = min(fits + stride, too_big)
    else:
      too_big = first
      while too_big - stride > fits and not runs_beside(too_big - stride):
        too_big, stride = too_big - stride, stride * 2
      fits = max(too_big - stride, fits)
  while too_big - fits > 1:
    units = (fits + too_big) // 2
    fits, too_big = (units, too_big) if runs_beside(units) else (fits, units)
  return fits * resolution


def measure(config, steps: int, warmup: int, profile_dir: str = "", keep_hlo: bool = False,
            headroom: bool = False) -> dict:
  """Compiles and runs `config`'s train step in this process: its AOT memory, seconds per
  step over `steps` steps after `warmup`, tokens/s, TFLOP/s per chip, MFU, the device's
  memory statistics (and, with `headroom`, `largest_ballast`'s figure; with `keep_hlo`, the
  compiled program's text as `hlo`)."""
  import jax
  import numpy as np
  import moe_hk
  from launch.model import memory, train_step as steps_lib
  from launch.run import throughput
  settings = settings_lib.build(config, jax.device_count())
  mesh = moe_hk.make_mesh(**settings.mesh, devices=jax.devices())
  program = steps_lib.make_steps(settings, mesh)
  started = time.perf_counter()
  compiled = program.train.lower(*steps_lib.abstract_inputs(config, program)).compile()
  compile_s = time.perf_counter() - started
  state = program.init(jax.random.key(config.seed))
  rng = np.random.default_rng(config.data.seed)
  shape = (config.data.batch_size, config.data.seq_len + 1)
  batches = [jax.device_put(rng.integers(0, config.vocab_size, shape, np.int32),
                            program.batch_sharding) for _ in range(4)]
  first_loss = None
  for i in range(warmup):
    state, out = compiled(state, batches[i % 4])
    first_loss = float(out.loss) if first_loss is None else first_loss
  jax.block_until_ready(state)
  if profile_dir:
    jax.profiler.start_trace(profile_dir)
  started = time.perf_counter()
  for i in range(steps):
    state, out = compiled(state, batches[i % 4])
  jax.block_until_ready((state, out))
  seconds = (time.perf_counter() - started) / steps
  if profile_dir:
    jax.profiler.stop_trace()
  device = jax.devices()[0]
  flops = throughput.model_flops(state.params, config, settings.layer)
  tflops, mfu = throughput.mfu(flops, seconds, jax.device_count(),
                               throughput.peak_tflops(device.device_kind, device.platform,
                                                      config.peak_tflops_per_device))
  stats = device.memory_stats() or {}
  figures = {
      "seconds_per_step": seconds, "compile_seconds": compile_s,
      "tokens_per_second": config.data.batch_size * config.data.seq_len / seconds,
      "model_tflops_per_device": tflops, "mfu": mfu, "model_flops_per_step": flops,
      "first_loss": first_loss, "last_loss": float(out.loss),
      "fallback_layers_last_step": int(np.sum(out.moe_stats.fallback)),
      "peak_bytes_in_use": stats.get("peak_bytes_in_use"),
      "bytes_limit": stats.get("bytes_limit"),
      "aot_total_bytes": memory.total_memory_bytes(compiled),
      "aot_temp_bytes": compiled.memory_analysis().temp_size_in_bytes,
      "memory_stats": stats,
      # What the TPU runtime holds for the step: the live arrays (the train state, batches)
      # and the reservation it makes for the program's temporaries at its launch.
      "chip_bytes": (stats["peak_bytes_in_use"] + stats["peak_bytes_reserved"]
                     if "peak_bytes_reserved" in stats else None),
      **({"hlo": compiled.as_text()} if keep_hlo else {}),
  }
  if headroom and "bytes_limit" in stats:
    state = out = None  # each try starts from a fresh state, as a run's first step does
    held = figures["chip_bytes"]
    figures["ballast_bytes"] = largest_ballast(
        compiled, lambda: program.init(jax.random.key(config.seed)), batches[0],
        stats["bytes_limit"], guess=stats["bytes_limit"] - held if held else None)
    figures["chip_bytes_by_ballast"] = stats["bytes_limit"] - figures["ballast_bytes"]
  return figures


def cases(args) -> list[tuple[str, dict]]:
  """(name, config overrides, whether to bisect the ballast) of every case asked for: the
  memory cases find what the step holds on the device (`largest_ballast`)."""
  speed = [(f"speed attention={a} gmm={g}", {"attention_impl": a, "moe.gmm_impl": g}, False)
           for a in args.attention for g in args.gmm]
  memory = [(f"memory {name}", MEMORY_CASES[name], True) for name in args.memory]
  return speed + memory


def _child(args, overrides: dict, headroom: bool, cache_dir: str) -> dict:
  """Runs one case in a new process (its own peak memory), compiling through the persistent
  cache `cache_dir` that every case shares (a case whose program another compiled loads it);
  its JSON result and the seconds the process took."""
  argv = [sys.executable, "-m", "benchmarks.chip_step", f"--config={args.config}",
          f"--steps={args.steps}", f"--warmup={args.warmup}", "--child=" + json.dumps(overrides),
          *(["--headroom"] if headroom else []), *args.config_flags]
  if args.profile_dir:
    argv.append(f"--profile_dir={args.profile_dir}")
  started = time.perf_counter()
  done = subprocess.run(argv, capture_output=True, text=True, cwd=results.ROOT,
                        env={**os.environ, "JAX_COMPILATION_CACHE_DIR": cache_dir})
  wall = {"wall_seconds": round(time.perf_counter() - started, 1)}
  if done.returncode:
    return {"error": (done.stderr.strip().splitlines() or ["exit %d" % done.returncode])[-1],
            **wall}
  return {**json.loads(done.stdout.strip().splitlines()[-1]), **wall}


def _table(rows: list[dict]) -> str:
  lines = ["| case | s/step | tokens/s | TFLOP/s/chip | MFU | chip GiB (in use + reserved) | "
           "chip GiB (ballast) | AOT GiB | first loss | case's s |",
           "|---|---|---|---|---|---|---|---|---|---|"]
  gib = lambda b: f"{b / 2**30:.2f}" if b else "-"
  for row in rows:
    if "error" in row:
      lines.append(f"| {row['case']} | error: {row['error']} |||||||| {row['wall_seconds']} |")
      continue
    mfu = f"{row['mfu']:.1%}" if row["mfu"] is not None else "-"
    lines.append(f"| {row['case']} | {row['seconds_per_step']:.3f} | "
                 f"{row['tokens_per_second']:,.0f} | {row['model_tflops_per_device']:.1f} | {mfu} "
                 f"| {gib(row['chip_bytes'])} | {gib(row.get('chip_bytes_by_ballast'))} | "
                 f"{gib(row['aot_total_bytes'])} | "
                 f"{row['first_loss']:.3f} | {row['wall_seconds']:.0f} |")
  return "\n".join(lines)


def main(argv: list[str]) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--config", default=os.path.join(settings_lib.CONFIGS, "tpu_chip.py"))
  parser.add_argument("--steps", type=int, default=10)
  parser.add_argument("--warmup", type=int, default=3)
  split = lambda text: [t for t in text.split(",") if t]
  parser.add_argument("--attention", type=split, default=["auto"])
  parser.add_argument("--gmm", type=split, default=["ragged_dot", "megablox"])
  parser.add_argument("--memory", type=split, default=list(MEMORY_CASES))
  parser.add_argument("--profile_dir", default="")
  parser.add_argument("--results", default="chip_step")
  parser.add_argument("--child", default="")
  parser.add_argument("--headroom", action="store_true")
  args, config_flags = parser.parse_known_args(argv[1:])
  args.config_flags = config_flags
  unknown = [name for name in args.memory if name not in MEMORY_CASES]
  if unknown:
    raise SystemExit(f"chip_step: --memory={','.join(args.memory)}: {', '.join(unknown)} is no "
                     f"memory case; the cases are {', '.join(MEMORY_CASES)}")
  if args.child:
    overrides = [(k, str(v)) for k, v in json.loads(args.child).items()]
    overrides += [tuple(f[len("--config."):].split("=", 1)) for f in config_flags]
    config = settings_lib.load(args.config, overrides)
    platform.setup(settings_lib.cpu_devices(config))
    figures = measure(config, args.steps, args.warmup, args.profile_dir,
                      headroom=args.headroom)
    print(json.dumps({**figures, "machine": results.machine()}))
    return
  # This process starts no jax backend: each case's process holds the chip in turn, and
  # names the machine it measured on.
  rows = []
  with tempfile.TemporaryDirectory(prefix="chip_step_cache") as cache_dir:
    for name, overrides, headroom in cases(args):
      rows.append({"case": name, "overrides": overrides,
                   **_child(args, overrides, headroom, cache_dir)})
      print(f"{name}: {json.dumps(rows[-1])}", flush=True)
  measured_on = next((row.pop("machine") for row in rows if "machine" in row), None)
  for row in rows:
    row.pop("machine", None)
  figures = {"config": os.path.relpath(args.config, results.ROOT), "steps": args.steps,
             "warmup": args.warmup, "cases": rows}
  if args.results:
    print("written:", results.write(args.results, figures, argv, measured_on))
  print("\n" + _table(rows))


if __name__ == "__main__":
  main(sys.argv)
