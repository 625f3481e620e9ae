"""Converts public checkpoints to launcher runs and back (docs/checkpoints.md).

  python -m launch.convert --from_hf=DIR --workdir=W [--config=FILE] [--config.KEY=V ...]
  python -m launch.convert --to_hf=DIR --workdir=W [--step=N] [--max_shard_mib=4096]

`--from_hf` reads a Hugging Face checkpoint of a supported family (Mixtral, Qwen3-MoE:
config.json and *.safetensors) and writes W as a run at step 0 whose model keys come from
config.json and whose training settings come from --config and its overrides; it prints the
semantics it mapped, and refuses in one line what the model does not implement.
`python -m launch.train --workdir=W` fine-tunes it (with the config it recorded). `--to_hf` writes
such a run's checkpoint (the newest, or --step) in the family's published layout and the dtype
it was imported in, for `transformers.AutoModelForCausalLM.from_pretrained(DIR)`.
"""
import jax
from absl import flags, logging

from launch.hf import exporting, importing
from launch.setup import cli, distributed, platform, settings as settings_lib
from launch.setup.errors import UserError

_FROM = flags.DEFINE_string("from_hf", None, "A Hugging Face checkpoint folder to import.")
_TO = flags.DEFINE_string("to_hf", None, "A folder to export the run's checkpoint to.")
_WORKDIR = flags.DEFINE_string("workdir", None, "The run's folder.", required=True)
_CONFIG = cli.define_config("config", "default.py", "Training configuration (--from_hf); its "
                            "model keys are replaced by the checkpoint's.")
_STEP = flags.DEFINE_integer("step", None, "--to_hf: the checkpoint to export (the newest by "
                             "default).")
_MAX_SHARD_MIB = flags.DEFINE_integer("max_shard_mib", 4096, "--to_hf: the largest safetensors "
                                      "file; past it the weights are split, with an index.")


def main(argv):
  del argv  # launch.setup.cli refuses arguments that are not flags
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)  # orbax's INFO lines only with --verbosity=1
  if (_FROM.value is None) == (_TO.value is None):
    raise UserError("pass exactly one of --from_hf=DIR (import) and --to_hf=DIR (export).")
  if _MAX_SHARD_MIB.value < 1:
    raise UserError(f"--max_shard_mib={_MAX_SHARD_MIB.value} must be >= 1.")
  config = _CONFIG.value if _FROM.value is not None else settings_lib.saved(_WORKDIR.value)
  # On a TPU pod (or another cluster jax detects) every host runs this command: each reads
  # only the slices its own devices hold; one CPU machine is one process.
  distributed.initialize_distributed(None, None, None,
                                     platform.setup(settings_lib.cpu_devices(config)))
  cli.set_process(jax.process_index(), jax.process_count())
  if _FROM.value is not None:
    said = importing.import_checkpoint(_FROM.value, _WORKDIR.value, _CONFIG.value)
    said += (f"\nwrote {_WORKDIR.value} at step 0; fine-tune: "
             f"{cli.runnable('python', '-m', 'launch.train', f'--workdir={_WORKDIR.value}')}")
  else:
    said = exporting.export_run(_WORKDIR.value, _TO.value, _STEP.value,
                                _MAX_SHARD_MIB.value << 20)
  if jax.process_index() == 0:
    print(said)


if __name__ == "__main__":
  cli.run(main)
