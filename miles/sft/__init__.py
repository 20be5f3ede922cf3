"""Supervised fine-tuning: examples built as the chat template trains them (`examples`) and the SFT loop (`loop`)."""
