"""Training: the loop (`trainer`), its compiled steps, the model, data, checkpoints, console."""
