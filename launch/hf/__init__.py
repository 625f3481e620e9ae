"""Hugging Face checkpoints in and out (`launch.convert`): the families' name mappings
(`mixtral`, `qwen3_moe`, over `family`), their config.json (`hf_config`), and streaming
safetensors into and out of the run's sharded parameters (`reading`, `writing`)."""
