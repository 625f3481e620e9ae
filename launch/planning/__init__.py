"""Planning the buffer factor: the autopilot, the step-time model, timed and compiled programs
per factor, FLOPs, and the replay of recorded traffic behind `launch.capacity`."""
