"""Where the train step's time goes on the chip: a `jax.profiler` trace of the launcher's step,
its device ops summed by the part of the model they belong to.

  python -m benchmarks.chip_profile [--config=launch/configs/tpu_chip.py] [--steps=5]
      [--results=chip_profile] [--config.KEY=VALUE ...]

The step is `launch.model.train_step.make_steps`' (what `launch.train` runs), compiled and run
as `benchmarks.chip_step` runs it; `--steps` steps are traced after the warm-up. Each device op
of the trace (the TPU's "XLA Ops" line) is matched to its instruction in the compiled program,
whose metadata holds the jax name stack it came from (`model/groups/block_1/moe/...`,
`transpose(jvp(...))` in the backward, `rematted_computation` in a recompute); `part` names
the part of the step by that stack. Device time not covered by any op is the chip waiting
(for the host, a callback, the next step's launch).

Writes `benchmarks/results/<--results>.json`: per part, milliseconds per step and the share of
the step; the same split into forward, backward and recompute; the 25 costliest ops.
"""
from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import sys
import tempfile

from benchmarks import chip_step
from launch.setup import platform, results, settings as settings_lib

# The step's parts, first match wins: (part, a regular expression searched in the op's name
# stack, or in its HLO instruction for `hlo:` patterns).
PARTS = (
    ("host callbacks", r"hlo:xla_python|hlo:callback"),
    ("attention kernel (splash)", r"hlo:splash|hlo:flash"),
    ("expert matmuls", r"hlo:ragged-dot|ragged_dot|gmm|megablox"),
    ("MoE routing, permutation, exchange, overflow check", r"/moe/"),
    ("loss and output projection", r"bsd,vd->bsv|logsumexp|take_along_axis|/embed/|jvp\(\)"),
    ("optimizer, gradient norm, update", r"^jit\(train_step\)/(?!.*(jvp|transpose))"),
    ("dense matmuls (q, k, v, o, dense MLP)", r"_group/model/.*dot_general"),
    ("norms, rotary, residuals, casts", r"_group/model/"),
    ("layer scan: stacked weights sliced, gradients stacked", r"dynamic_(update_)?index_in_dim"),
)
PASSES = (("recompute (remat)", r"rematted_computation"), ("backward", r"transpose\("),
          ("forward", r"jvp\("), ("outside the gradient", r"^jit"))


def op_metadata(hlo_text: str) -> dict[str, tuple[str, str]]:
  """Instruction name -> (its op_name metadata, its HLO line) in a compiled program's text;
  a fusion without metadata of its own takes the first op_name inside its computation."""
  found, inner, computation = {}, {}, None
  for line in hlo_text.splitlines():
    header = re.match(r"%?([\w.\-]+) \(.*\{$", line)
    if header:
      computation = header.group(1)
    match = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = ", line)
    if match:
      name = re.search(r'op_name="([^"]*)"', line)
      found[match.group(1)] = (name.group(1) if name else "", line.strip()[:400])
      if name and computation:
        inner.setdefault(computation, name.group(1))
  for key, (name, line) in found.items():
    calls = re.search(r"calls=%?([\w.\-]+)", line)
    if not name and calls:
      found[key] = (inner.get(calls.group(1), ""), line)
  return found


def classify(op_name: str, hlo_line: str, rules,
             default: str = "other (copies, layout, unnamed fusions)") -> str:
  """The first rule's name whose pattern matches (`hlo:` patterns the HLO line), else
  `default`."""
  for part, pattern in rules:
    text = hlo_line if pattern.startswith("hlo:") else op_name
    if re.search(pattern.removeprefix("hlo:"), text):
      return part
  return default


def device_ops(trace_dir: str) -> tuple[list, int]:
  """The TPU's ops in the trace under `trace_dir`, each `(instruction name, self time ns)`,
  and the span from the first op's start to the last op's end (ns). An op's self time leaves
  out the ops that ran inside it (a `while` loop's body, a conditional's branch)."""
  from jax.profiler import ProfileData
  path = max(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True),
             key=os.path.getmtime)
  plane = next(p for p in ProfileData.from_file(path).planes
               if p.name.startswith("/device:TPU:0"))
  line = next(l for l in plane.lines if l.name == "XLA Ops")
  events = sorted(((e.start_ns, e.start_ns + e.duration_ns, e.name) for e in line.events),
                  key=lambda e: (e[0], -e[1]))
  self_ns, open_ = collections.Counter(), []  # open_: the enclosing ops, innermost last
  for start, end, text in events:
    while open_ and open_[-1][0] <= start:
      open_.pop()
    name = re.match(r"\s*%?([\w.\-]+)", text).group(1)
    self_ns[name] += end - start
    if open_:
      self_ns[open_[-1][1]] -= end - start
    open_.append((end, name))
  span = max(e[1] for e in events) - min(e[0] for e in events)
  return list(self_ns.items()), span


def breakdown(events, span_ns: int, steps: int, metadata: dict) -> dict:
  """Per part and per pass: ms per step and share of the traced span; the costliest ops."""
  parts, passes, ops = (collections.Counter() for _ in range(3))
  for name, duration in events:
    op_name, line = metadata.get(name, ("", ""))
    parts[classify(op_name, line, PARTS)] += duration
    passes[classify(op_name, line, PASSES, "no name stack (kernels, copies)")] += duration
    ops[name] += duration
  busy = sum(parts.values())
  parts["chip idle (no op running)"] = max(span_ns - busy, 0)
  per_step = lambda ns: round(ns / steps / 1e6, 3)
  table = lambda counts: [{"part": k, "ms_per_step": per_step(v), "share": round(v / span_ns, 4)}
                          for k, v in counts.most_common()]
  return {"step_ms": per_step(span_ns), "parts": table(parts), "passes": table(passes),
          "top_ops": [{"op": k, "ms_per_step": per_step(v), "op_name": metadata.get(k, ("",))[0],
                       "hlo": metadata.get(k, ("", ""))[1][:200]}
                      for k, v in ops.most_common(25)]}


def main(argv: list[str]) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--config", default=os.path.join(settings_lib.CONFIGS, "tpu_chip.py"))
  parser.add_argument("--steps", type=int, default=5)
  parser.add_argument("--warmup", type=int, default=3)
  parser.add_argument("--trace_dir", default="",
                      help="keep the trace and the program's text (program.hlo.txt) here")
  results.add_argument(parser, "chip_profile")
  args, config_flags = parser.parse_known_args(argv[1:])
  config = settings_lib.load(args.config, [tuple(f[len("--config."):].split("=", 1))
                                           for f in config_flags])
  platform.setup(settings_lib.cpu_devices(config))
  import jax
  if jax.devices()[0].platform != "tpu":
    sys.exit(f"chip_profile: needs a TPU chip (it reads the TPU's op line of the trace); this "
             f"machine runs jax on {jax.devices()[0].platform} (there: benchmarks.chip_step)")
  with tempfile.TemporaryDirectory() as scratch:
    trace_dir = args.trace_dir or scratch
    figures = chip_step.measure(config, args.steps, args.warmup, profile_dir=trace_dir,
                                keep_hlo=True)
    hlo = figures.pop("hlo")
    if args.trace_dir:
      with open(os.path.join(trace_dir, "program.hlo.txt"), "w") as f:
        f.write(hlo)
    events, span = device_ops(trace_dir)
  split = breakdown(events, span, args.steps, op_metadata(hlo))
  figures = {"config": os.path.relpath(args.config, results.ROOT), "steps": args.steps,
             **figures, **split}
  results.publish(args.results, figures)
  print("\n| part | ms/step | share |\n|---|---|---|")
  for row in split["parts"] + split["passes"]:
    print(f"| {row['part']} | {row['ms_per_step']:.1f} | {row['share']:.1%} |")


if __name__ == "__main__":
  main(sys.argv)
