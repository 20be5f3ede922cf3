"""The run's configuration: typed Hydra schemas (`schema`), where configs and recipes live and how overrides
are checked (`store`), and the one check of a whole config at start, before anything heavy loads (`validate`)."""

from miles.config.schema import (
    AlgorithmConfig,
    DataConfig,
    LoggingConfig,
    MilesConfig,
    ModelConfig,
    OptimConfig,
    PlacementConfig,
    RewardConfig,
    RolloutConfig,
    TrainerConfig,
)

__all__ = [
    "AlgorithmConfig",
    "DataConfig",
    "LoggingConfig",
    "MilesConfig",
    "ModelConfig",
    "OptimConfig",
    "PlacementConfig",
    "RewardConfig",
    "RolloutConfig",
    "TrainerConfig",
]
