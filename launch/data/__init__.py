"""The training data: the sources served as this process's rows (`loader`), where prepared
token files came from (`provenance`), and what `launch.batch` prints of a batch
(`batch_view`)."""
