"""Where the loop's roles run past one process: an engine in a process of its own (`engine_process`), and
trainer ranks and engines as Ray actors (`ray/`)."""
