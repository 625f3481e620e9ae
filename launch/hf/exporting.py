"""`launch.convert --to_hf`: a run imported by `--from_hf` as a Hugging Face checkpoint.

The folder gets `config.json` (the imported one, the RoPE base and scaling at the top level and
in `rope_parameters`; a multimodal Llama 4's language model as `llama4_text`), the weights in
the family's published layout and the dtype the import read, and the tokenizer files the run
keeps.
"""
from __future__ import annotations

import json
import os
import shutil

import jax

from launch.checkpoints import parameters
from launch.hf import hf_config, importing, writing
from launch.setup import settings as settings_lib
from launch.setup.errors import UserError


def source_of(workdir: str) -> dict:
  """What `--from_hf` recorded in `workdir`; UserError for a run it did not write."""
  path = os.path.join(workdir, importing.SOURCE)
  if not os.path.isfile(path):
    raise UserError(f"--workdir={workdir}: no {importing.SOURCE} there; --to_hf exports runs "
                    "that launch.convert --from_hf started (the family and dtype come from it).")
  with open(path) as f:
    return json.load(f)


def export_run(workdir: str, folder: str, step: int | None, max_bytes: int) -> str:
  """Writes checkpoint `step` (None: the newest) of the run in `workdir` to `folder`;
  returns a line saying what was written."""
  source = source_of(workdir)
  hf, family = hf_config.exported(source["config"], source["dtype"])
  settings = settings_lib.build(settings_lib.saved(workdir), jax.device_count())
  step, params = parameters.restore_params(settings, workdir, step)
  named = writing.hf_tensors(params, family.tensors(hf_config.model_keys(hf)), source["dtype"])
  if jax.process_index() != 0:
    for _ in named:  # every process takes part in each leaf's gather
      pass
    return ""
  files = writing.write(folder, named, max_bytes)
  with open(os.path.join(folder, "config.json"), "w") as f:
    json.dump(hf, f, indent=2)
  for name in importing.TOKENIZER_FILES:
    if os.path.isfile(os.path.join(workdir, name)):
      shutil.copy(os.path.join(workdir, name), os.path.join(folder, name))
  return (f"wrote step {step} of {workdir} as {family.architecture} ({source['dtype']}) to "
          f"{folder}: {len(files)} safetensors file{'s' if len(files) > 1 else ''}")
