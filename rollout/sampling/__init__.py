"""Sampling with exact logprobs: the request's `SamplingParams` (`params`), the sampler (`sampler`), its Triton
block kernel (`triton_kernel`), its CUDA graphs (`graph`) and the engine's per-row settings (`rows`)."""
