"""`trainer.backend=deepspeed`: our `CausalLM` under a DeepSpeed ZeRO engine, with its config."""
