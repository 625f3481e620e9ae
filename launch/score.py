"""Scores token ids or text with a run's model: the check of a converted checkpoint, and an
evaluation of a trained one.

  python -m launch.score --workdir=W --input_ids=IN.npy --output=OUT.npy [--step=N]
  python -m launch.score --workdir=W --text="Some text" [--step=N]

`--input_ids` takes int32 token ids `[B, S]` and writes the model's float32 logits
`[B, S, V]` to `--output`. `--text` encodes the text with the run's `tokenizer.json` (kept by
`launch.convert --from_hf`; bytes when the run has none) and prints each next token's loss
(nats) and the perplexity. The model runs as the run's config says (its buffer factor and
fallback); the line printed says in how many MoE layers the dropless fallback ran. A text too
short for the fallback's chunks on the run's expert shards runs the worst-case buffer instead
(nothing is dropped either way), and the line says so.
"""
import os

import jax
import numpy as np
import tokenizers
from absl import flags, logging

import moe_hk
from launch.checkpoints import parameters
from launch.model import scoring
from launch.setup import cli, platform, settings as settings_lib
from launch.setup.errors import UserError

_WORKDIR = flags.DEFINE_string("workdir", None, "The run's folder.", required=True)
_INPUT_IDS = flags.DEFINE_string("input_ids", None, "A .npy of int32 token ids [B, S].")
_OUTPUT = flags.DEFINE_string("output", None, "Where --input_ids' float32 logits [B, S, V] go.")
_TEXT = flags.DEFINE_string("text", None, "Text to score, with the run's tokenizer.json.")
_STEP = flags.DEFINE_integer("step", None, "The checkpoint to score (the newest by default).")


def _tokens(workdir: str, vocab: int) -> tuple[np.ndarray, list[str]]:
  """`--input_ids`' ids `[B, S]`, or `--text`'s `[1, S]` and each token's text; UserError
  for ids outside the vocabulary."""
  path = os.path.join(workdir, "tokenizer.json")
  if _TEXT.value is None:
    ids, pieces, what = np.load(_INPUT_IDS.value), [], f"--input_ids={_INPUT_IDS.value}"
  elif os.path.isfile(path):
    encoding = tokenizers.Tokenizer.from_file(path).encode(_TEXT.value)
    ids, pieces, what = np.asarray([encoding.ids]), list(encoding.tokens), path
  else:
    data = _TEXT.value.encode()
    ids, pieces, what = np.frombuffer(data, np.uint8)[None], [chr(b) for b in data], "bytes"
  if ids.ndim != 2 or ids.dtype.kind not in "iu" or ids.size == 0 or not (
      0 <= ids.min() and ids.max() < vocab):
    raise UserError(f"{what}: ids {ids.dtype} {list(ids.shape)} must be integer token ids "
                    f"[B, S] in [0, {vocab}) (the run's config.vocab_size).")
  return ids.astype(np.int32), pieces


def main(argv):
  del argv  # launch.setup.cli refuses arguments that are not flags
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)  # orbax's INFO lines only with --verbosity=1
  if (_TEXT.value is None) == (_INPUT_IDS.value is None) or (
      _INPUT_IDS.value is not None and _OUTPUT.value is None):
    raise UserError("pass --input_ids=IN.npy with --output=OUT.npy, or --text=TEXT.")
  config = settings_lib.saved(_WORKDIR.value)
  platform.setup(settings_lib.cpu_devices(config))
  settings = settings_lib.build(config, jax.device_count(), platform=jax.devices()[0].platform)
  ids, pieces = _tokens(_WORKDIR.value, config.vocab_size)
  step, params = parameters.restore_params(settings, _WORKDIR.value, _STEP.value)
  mesh = moe_hk.make_mesh(**settings.mesh)
  tokens = scoring.padded(ids, mesh.size)
  settings, note = scoring.fitted(settings, tokens.shape, mesh.size)
  logits, stats = scoring.forward(settings, mesh)(params, tokens)
  logits = np.asarray(logits)[:ids.shape[0]]
  print(f"step {step}: logits {list(logits.shape)}; the dropless fallback ran in "
        f"{int(np.sum(stats.fallback))} of {settings.moe_layers} MoE layers" +
        (f"; {note}" if note else ""))
  if _TEXT.value is None:
    np.save(_OUTPUT.value, logits.astype(np.float32))
    return
  losses = scoring.token_losses(logits, ids)[0]
  for piece, loss in zip(pieces[1:], losses):
    print(f"{piece!r}\t{loss:.4f}")
  print(f"{len(losses)} tokens: mean loss {losses.mean():.4f} nats, perplexity "
        f"{np.exp(losses.mean()):.3f}")


if __name__ == "__main__":
  cli.run(main)
