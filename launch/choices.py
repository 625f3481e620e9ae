"""The values the launcher's checked keys may take, in one module that imports nothing: the
settings check them (`launch.settings`) and the code that acts on them (`launch.training`'s
attention, model, data and spikes) takes them from here, which also keeps
`launch.training.data` free of jax for the data tools."""

ATTENTION_IMPLS = ("auto", "xla", "splash", "cudnn")
REMAT_POLICIES = ("none", "full", "save_attention_moe", "save_dots", "full_inputs_on_host")
ROPE_LAYOUTS = ("rotate_half", "interleaved")  # which dimensions a rotary pair joins
ROPE_SCALINGS = ("none", "llama3")             # config.rope_scaling.type
DATA_SOURCES = ("stdlib", "synthetic", "files", "array_record")
SPIKE_MIN_STEPS = 4  # applied steps in the spike window before any step is judged
