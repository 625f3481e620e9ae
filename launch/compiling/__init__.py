"""Ahead-of-time compiles: topologies, the MoE variants `launch.aot` compares, compiled memory."""
