"""How much memory the KV pool(s) get, and whether the pool keeps its addresses across a release."""

from __future__ import annotations

import torch

from miles.config import RolloutConfig
from miles.rollout.kv import virtual_memory


def keeps_kv_addresses(cfg: RolloutConfig, device: torch.device) -> bool:
    """Whether the pool lives at reserved virtual addresses (`rollout.kv_virtual_memory`)."""
    mode = cfg.kv_virtual_memory
    if device.type != "cuda" or mode == "off":
        return False
    if mode == "on":
        return True  # without driver support VirtualRegion says what to do
    # auto: only where the pool will be released; otherwise torch's allocator keeps it in its accounting
    return cfg.release_kv_during_train and virtual_memory.supported(device)


def kv_budget_bytes(cfg: RolloutConfig, device: torch.device, reserve_bytes: int) -> int:
    """Bytes for the KV pool(s): a fraction of the free device memory less `reserve_bytes` (what a colocated
    trainer allocates later), or kv_cache_bytes on CPU."""
    if device.type == "cuda":
        virtual_memory.free_orphans()  # a dead engine's pool, collected during a capture
        torch.cuda.synchronize(device)
        free, _ = torch.cuda.mem_get_info(device)
        free = max(0, free - reserve_bytes)
        return int(free * cfg.kv_cache_fraction)
    return cfg.kv_cache_bytes
