"""The model and its compiled steps: the MoE transformer (`transformer`, over `attention` and
`positions`), where its state lives on the mesh (`sharding`), the jitted init / train / eval
steps (`train_step`, with the in-step `spikes` test), what a compiled program holds
(`memory`), and the model as a scorer (`scoring`)."""
