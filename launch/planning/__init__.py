"""Planning the buffer factor, host-only (numpy, no jax: an import-linter contract): the
autopilot's controller and program cache, the replay of recorded traffic and the report behind
`launch.capacity`."""
