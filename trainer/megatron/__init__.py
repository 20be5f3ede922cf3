"""`trainer.backend=megatron`: megatron-core's GPTModel, its experts, routers and parallel layouts."""
