"""The values the launcher's checked keys may take, in one module that imports nothing: the
settings check them (`launch.setup.settings`) and the code that acts on them (`launch.model`'s
attention, transformer and spikes, `launch.data.loader`) takes them from here, which also keeps
`launch.data.loader` free of jax for the data tools. `resolve_attention` says which
attention form runs on a platform, for the settings' check and the model alike."""

ATTENTION_IMPLS = ("auto", "xla", "splash", "cudnn")
REMAT_POLICIES = ("none", "full", "save_attention_moe", "save_dots", "save_matmuls",
                  "full_inputs_on_host")
REMAT_UNITS = ("group", "block")  # what one remat unit holds: a layer group, or one block
ROPE_LAYOUTS = ("rotate_half", "interleaved")  # which dimensions a rotary pair joins
ROPE_SCALINGS = ("none", "llama3")             # config.rope_scaling.type
DATA_SOURCES = ("stdlib", "synthetic", "files", "array_record")
SPIKE_MIN_STEPS = 4  # applied steps in the spike window before any step is judged

# The form 'auto' picks per platform (any other platform gets 'xla'), and where the two kernel
# forms can run at all.
_AUTO = {"tpu": "splash", "gpu": "cudnn", "cuda": "cudnn"}
_RUNS_ON = {"splash": ("tpu",), "cudnn": ("gpu", "cuda")}


def resolve_attention(impl: str, platform: str) -> str:
  """The attention form for `config.attention_impl` on `platform` ('cpu', 'tpu', 'gpu'/'cuda').

  'auto' is 'splash' on TPU, 'cudnn' on GPU and 'xla' elsewhere; a kernel form asked for
  off its platform, or an unknown name, is a ValueError.
  """
  if impl not in ATTENTION_IMPLS:
    raise ValueError(f"config.attention_impl={impl!r} is not one of {ATTENTION_IMPLS}.")
  if impl == "auto":
    return _AUTO.get(platform, "xla")
  valid = _valid_on(platform)
  if impl not in valid:
    raise ValueError(
        f"config.attention_impl={impl!r} runs only on {'/'.join(_RUNS_ON[impl])}, not on "
        f"platform {platform!r}; valid choices there: {valid}.")
  return impl


def _valid_on(platform: str) -> tuple[str, ...]:
  """The names of ATTENTION_IMPLS that can run on `platform`."""
  return tuple(i for i in ATTENTION_IMPLS if i not in _RUNS_ON or platform in _RUNS_ON[i])
