"""One training run (`python -m launch.train`): the trainer that sets it up (`trainer`), its
loop (`loop`) and the step path: the fetched outputs become records (`records`, by
`reporter`), handed in order (`hooks`) to the consumers (`consumers`): TensorBoard, alerts
(`trainer_alerts`), the console (`console`, with `throughput`'s rates). `stop_request`: SIGTERM
and Ctrl-C read between steps."""
