"""`trainer.distributed_optimizer`: float32 masters and AdamW moments sharded over the data-parallel ranks."""
