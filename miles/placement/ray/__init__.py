"""`placement.mode=ray`: trainer ranks and engines as Ray actors (docs/placement.md). Ray itself is imported
only when a run uses it (`pip install -e ".[ray]"`)."""
