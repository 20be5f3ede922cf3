"""Device time per decode step of `qwen3-0.6b` at batch 64, by kernel (docs/benchmarks.md, "Small models").

    python3 docs/scripts/gpu_kernel_profile.py

`torch.profiler` with CUDA activity over decode steps 11-30 of 64 prompts of 128 tokens (page 16).
"""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

from miles.config import RolloutConfig
from miles.models.presets import build_random_model, preset_args
from miles.rollout.engine import Engine
from miles.rollout.sampling.params import SamplingParams

STEPS = 20


def main() -> None:
    args = preset_args(None, "qwen3-0.6b")
    model = build_random_model(args, torch.bfloat16, torch.device("cuda"), seed=0).eval()
    cfg = RolloutConfig(page_size=16, max_running_requests=1024, max_batch_tokens=16384)
    engine = Engine(model, None, cfg)
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, args.vocab_size, (64, 128), generator=gen).tolist()
    params = SamplingParams(n=1, temperature=1.0, max_new_tokens=128, ignore_eos=True, seed=0)
    engine.generate(prompts, params)
    engine.flush_cache()
    for prompt in prompts:
        engine.add_request(prompt, params)
    for _ in range(10):
        engine.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(STEPS):
            engine.step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels.sort(key=lambda e: -e.self_device_time_total)
    total = sum(e.self_device_time_total for e in kernels)
    launches = sum(e.count for e in kernels)
    print(f"device µs per step: {total / STEPS:.0f} over {launches / STEPS:.0f} kernel launches per step")
    for e in kernels[:25]:
        print(f"{e.self_device_time_total / STEPS:7.1f} µs/step {e.count / STEPS:5.1f}/step  {e.key[:110]}")


if __name__ == "__main__":
    main()
