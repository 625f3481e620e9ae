"""Compiles the full train step for a topology and prints device memory per MoE variant.

  python -m launch.aot --config=launch/configs/maverick.py --compile_topology=v5p-256 \
      [--variants=capped,fallback_scan,...|all] [--config.KEY=VALUE ...]

The topology is a TPU slice (`v5p-256`, i.e. 128 chips, or `v5p:4x4x8`), compiled through
libtpu with no TPU attached, or `cpu:N` (N simulated CPU devices); jax stays on the CPU either
way (launch.setup.platform), so it never takes the chips of a TPU VM. Every variant compiles the
same step as `launch.train` (`launch.compiling.variants`); by default only the variant the
config trains (its pre-flight check), `all` for every one. Prints JSON, then a table of
per-device memory (arguments + outputs + temporaries - aliased) from
`compiled.memory_analysis()`, and the step's matmul FLOPs (all devices, loops at their trip
counts: `launch.compiling.flops`; XLA's `cost_analysis()` counts a loop body once, so it is in
the JSON only) beside 6 x active parameters x tokens. A variant whose temporaries exceed the
chip's HBM does not compile for TPU; its row then shows the compiler's stated temporaries
plus the argument shards. The figures go to `benchmarks/results/<--results>.json` too.

Each row records its `program`: a digest of what the compiler was given (the lowered program,
jax, jaxlib and libtpu, the devices, the XLA flags: `launch.compiling.program_key`).
`--reuse=FILE` reads back the rows of an earlier results file whose program is this run's,
instead of compiling them again (`"reused": true`): a compile is deterministic, and a Maverick
variant takes minutes.
"""
import concurrent.futures
import json
import os
import sys

import jax
from absl import flags

from launch.compiling import topology as topology_lib
from launch.setup import cli, platform, results, settings as settings_lib
from launch.compiling.variants import (GIB, VARIANTS, compile_variant, model_flops,
                                      trained_variant)
from launch.setup.errors import UserError, user_errors

_CONFIG = cli.define_config("config", "maverick.py", "Model configuration file.")
_TOPOLOGY = topology_lib.topology_flag("v5p-256", "'v5p-N', 'v5p:AxBxC' or 'cpu:N'.")
_VARIANTS = flags.DEFINE_list("variants", [], f"Any of {', '.join(VARIANTS)}, or 'all'; "
                              "default: the one the config trains.")
_JOBS = flags.DEFINE_integer("jobs", 1, "Variants compiled at once, on threads (a Maverick "
                             "variant: minutes of one core, 8 GB of host memory, the adaptive "
                             "one over 40; libtpu has crashed once on two tiny ones at once).",
                             lower_bound=1)
_REUSE = flags.DEFINE_string("reuse", None, "A results JSON of launch.aot (e.g. benchmarks/"
                             "results/aot_maverick_v5p-256_jax0.10.2.json): its rows whose "
                             "program is this run's are read back, not compiled.")
_RESULTS = flags.DEFINE_string("results", None, "Name of the JSON written to benchmarks/results/ "
                               "(default aot_<config>_<topology>[_<variants>]); '' writes none.")


def print_table(topology: str, settings: settings_lib.Settings, model: dict, rows: list[dict]
                ) -> None:
  """The per-variant memory and FLOPs table, after a line on the model."""
  capped = next((r["total_bytes"] for r in rows if r["variant"] == "capped"), None)
  hbm = topology_lib.hbm_gib(topology)
  print(f"\nper-device memory, {topology}, mesh {dict(settings.mesh)}" +
        (f", {hbm} GiB HBM per chip" if hbm else ""))
  print(f"{model['params'] / 1e9:.1f}B parameters, {model['active_params'] / 1e9:.2f}B active; "
        f"{model['tokens']} tokens per step: 6 x active x tokens = {model['six_n_t']:.3e} FLOPs, "
        f"+ attention {model['attention_flops']:.3e}")
  print("| variant | total GiB | args GiB | temp GiB | host temp GiB | vs capped | compiler "
        "accepts temp | total fits HBM | matmul FLOPs | / (6NT + attention) | compile s |")
  print("|---|---|---|---|---|---|---|---|---|---|---|")
  for r in rows:
    total = r["total_bytes"] / GIB
    ratio = f"{r['total_bytes'] / capped:.3f}x" if capped else "-"
    accepted = "yes" if r["compiled"] else f"no (> {r['hbm_bytes'] / GIB:.2f} GiB)"
    fits = "-" if hbm is None else ("yes" if total <= hbm else "no")
    flops = r.get("flops")
    flops_cells = (f"{flops:.3e} | {flops / (model['six_n_t'] + model['attention_flops']):.2f}"
                   if flops else "- | -")
    print(f"| {r['variant']} | {total:.2f} | {r['argument_bytes'] / GIB:.2f} | "
          f"{r['temp_bytes'] / GIB:.2f} | {r.get('host_temp_bytes', 0) / GIB:.2f} | {ratio} | "
          f"{accepted} | {fits} | {flops_cells} | "
          f"{'reused' if r.get('reused') else r['compile_seconds']} |")


def _variants(settings: settings_lib.Settings) -> list[str]:
  """--variants resolved: the config's own variant by default, every one for 'all'."""
  asked = list(_VARIANTS.value)
  if not asked:
    return [trained_variant(settings.layer)]
  if asked == ["all"]:
    return list(VARIANTS)
  unknown = sorted(set(asked) - set(VARIANTS))
  if unknown:
    raise UserError(f"--variants={','.join(asked)}: unknown {', '.join(unknown)}; valid: "
                    f"{', '.join(VARIANTS)}, or 'all'.")
  return asked


def known_rows(path: str | None) -> dict[str, dict]:
  """The rows of the results JSON at `path` that record their program, by program; none for
  no path (a file whose rows record none is said so on stderr: everything compiles)."""
  if path is None:
    return {}
  rows = results.read_rows(path, "--reuse", "launch.aot", "results")
  known = {r["program"]: r for r in rows if "program" in r}
  if not known:
    print(f"--reuse={path}: no row records its program (written before launch.aot recorded "
          "them): every variant compiles", file=sys.stderr)
  return known


def compile_variants(settings: settings_lib.Settings, devices, variants: list[str],
                     jobs: int, known: dict[str, dict] | None = None) -> list[dict]:
  """Each variant's row (`compile_variant` for `devices`), in `variants`' order; `jobs > 1`
  compiles that many at once, on threads of this process: XLA's compile, the minutes of a
  Maverick variant, runs outside Python's lock, and one process holds libtpu (on a TPU VM
  a second process's topology client cannot open the chips the first one holds). Each thread
  compiles at the caller's matmul precision: jax's config contexts hold for the thread that
  entered them, and the precision changes the TPU compiler's fusions, so its figures. Rows of
  `known` (by program) are read back, not compiled (`compile_variant`)."""
  precision = jax.config.jax_default_matmul_precision

  def compile_one(variant: str) -> dict:
    with jax.default_matmul_precision(precision):
      return compile_variant(settings, devices, variant, known)
  with concurrent.futures.ThreadPoolExecutor(min(jobs, len(variants))) as pool:
    return list(pool.map(compile_one, variants))


def main(argv):
  del argv  # launch.setup.cli refuses arguments that are not flags
  with user_errors():
    platform.setup(topology_lib.cpu_device_count(_TOPOLOGY.value), cpu_only=True)
    devices = topology_lib.topology_devices(_TOPOLOGY.value)
    known = known_rows(_REUSE.value)
  settings = settings_lib.build(_CONFIG.value, len(devices))
  variants = _variants(settings)
  rows = compile_variants(settings, devices, variants, _JOBS.value, known)
  model = model_flops(settings, devices)
  figures = {"topology": _TOPOLOGY.value, "devices": len(devices),
             "platform": devices[0].platform, "mesh": dict(settings.mesh), "model": model,
             "results": rows}
  print(json.dumps(figures, indent=2))
  print_table(_TOPOLOGY.value, settings, model, rows)
  name = _RESULTS.value
  if name is None:
    stem = os.path.splitext(os.path.basename(_CONFIG.path))[0]
    subset = "" if variants == list(VARIANTS) else "_" + "_".join(variants)
    name = f"aot_{stem}_{_TOPOLOGY.value.replace(':', '-')}{subset}"
  if name:
    print(f"\nwritten: {results.write(name, figures)}")


if __name__ == "__main__":
  cli.run(main)
