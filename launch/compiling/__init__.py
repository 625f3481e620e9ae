"""Programs compiled ahead: topologies, the MoE variants `launch.aot` compares (with their
FLOPs), the autopilot's program per buffer factor (`programs`), and the capped step timed at
each factor for `launch.capacity` (`capped_timing`)."""
