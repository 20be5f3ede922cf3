"""The `miles` commands that run a job: `train`, `generate`, `eval`, `reward` (`serve` and `bench` are wings of their own)."""
