"""miles: RL post-training where the rollout engine and the trainer are one system.

Imports stay light here (no torch at import time) so that `miles --help` is fast.
"""

from miles.sample import Sample, SampleStatus

__all__ = ["Sample", "SampleStatus", "__version__"]
__version__ = "0.1.0"
