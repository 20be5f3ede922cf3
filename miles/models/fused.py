"""The forward's elementwise chains (RMSNorm, RoPE, SwiGLU) as plain functions, optionally compiled.

Eager, each chain is several small kernels (float32 upcast, square, mean, rsqrt, cast, scale, ...). In a
large-batch decode step those kernels read and write [batch, hidden] tensors many times and cost about a
quarter of the step. Inside `fused_kernels()` the same functions run through `torch.compile`, which turns
each chain into one Triton kernel with the same math. The rollout engine switches it on for its own
forwards on CUDA; the trainer runs its forwards inside `compiled_chains()` (the same compiled functions,
with their backward, and none of the hand-written kernels) where `trainer.fused_kernels` says so.

`KernelSwitch` is the on/off state of each hand-written Triton kernel (`fused_moe`, `fused_norm_rope`,
`rollout.sampling_triton`): the first failure turns that kernel off and its callers fall back to these
functions (or the grouped GEMMs).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)
T = TypeVar("T")


def normalized(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x over its root mean square, computed in float32 and cast back (a new tensor): RMSNorm before the
    weight, which Hugging Face applies after the cast, so bf16 matches."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * normalized(x, eps)


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, rms_norm(x + delta)): a residual add and the next norm."""
    x = x + delta
    return x, rms_norm(x, weight, eps)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [N, H, D]; cos/sin: [N, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def rms_norm_rope(
    x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """Qwen3's per-head q/k norm followed by the rotary embedding."""
    return rope(rms_norm(x, weight, eps), cos, sin)


def qk_norm_rope(
    qk: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    num_q_heads: int,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> torch.Tensor:
    """`rms_norm_rope` of q and of k, over their heads side by side ([N, Hq + Hk, D], as the fused QKV
    projection lays them out): one compiled call where two were, the same arithmetic per element."""
    heads, dim = qk.shape[1], qk.shape[2]
    weight = torch.cat((q_weight.expand(num_q_heads, dim), k_weight.expand(heads - num_q_heads, dim)))
    return rms_norm_rope(qk, weight, eps, cos, sin)


def qk_norm_rope_inference(
    qk: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    num_q_heads: int,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> torch.Tensor:
    """`qk_norm_rope` in fewer eager kernels, without autograd: each norm weight scales its heads of the
    normalised rows in place instead of both being expanded into one [H, D] weight first (per element the
    same product, so the same bits)."""
    normed = normalized(qk, eps)
    normed[:, :num_q_heads].mul_(q_weight)
    normed[:, num_q_heads:].mul_(k_weight)
    return rope(normed, cos, sin)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def add_slot_sum(x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """x + the sum over dim 1 of a MoE layer's [N, top_k, H] per-slot expert outputs, summed in float32
    and rounded once, as `sum` does. Written as a chain of adds: compiled, that is one pointwise kernel
    (a reduction over the strided slot dim compiled ~7x slower than eager's reduce kernel)."""
    total = slots[:, 0].float()
    for j in range(1, slots.shape[1]):
        total = total + slots[:, j].float()
    return x + total.to(x.dtype)


def add_slot_sum_rms_norm(
    x: torch.Tensor, slots: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + the slot sum, its norm): a MoE layer's residual add (`add_slot_sum`) and the next norm."""
    x = add_slot_sum(x, slots)
    return x, rms_norm(x, weight, eps)


_enabled = False
_chains = False
_compiled: dict[Callable[..., Any], Callable[..., Any]] = {}
_failed = False
"""torch.compile failed in an engine forward: the engine's chains run eager from then on."""
_chains_failed = False
"""... in a trainer forward (its own flag, so a failure only autograd graphs hit leaves the engine's on)."""


@contextmanager
def fused_kernels(enabled: bool = True) -> Iterator[None]:
    """Run `call(fn, ...)` through compiled kernels within this block, and let the hand-written Triton
    kernels (`enabled()`) run (the engine's forwards)."""
    global _enabled
    previous, _enabled = _enabled, enabled
    try:
        yield
    finally:
        _enabled = previous


@contextmanager
def compiled_chains(enabled: bool = True) -> Iterator[None]:
    """Run `call(fn, ...)` compiled within this block, with autograd, and nothing else: the trainer's
    forwards, whose gradients the hand-written kernels (no backward) cannot give, and whose no-grad passes
    (old and reference logprobs) must compute what the training forward computes."""
    global _chains
    previous, _chains = _chains, enabled
    try:
        yield
    finally:
        _chains = previous


def enabled() -> bool:
    """Whether the caller runs inside `fused_kernels()` (the engine's own forwards on CUDA)."""
    return _enabled


def compiling() -> bool:
    """Whether `call` compiles here (inside `fused_kernels()` or `compiled_chains()`, and torch.compile has not
    failed there in this process)."""
    return (_enabled and not _failed) or (_chains and not _enabled and not _chains_failed)


def disable_chains(reason: str) -> None:
    """Trainer forwards run eager from now on (e.g. after a compiled backward failed)."""
    global _chains_failed
    if not _chains_failed:
        _chains_failed = True
        log.warning("compiled elementwise chains off for training (%s); running the eager ones", reason)


def reset() -> None:
    """Forget the compiled kernels, their guards and any earlier failure: for a process that goes on with
    other models and shapes (a test session), where torch.compile's recompile limit would turn them off."""
    global _failed, _chains_failed
    _compiled.clear()
    _failed = _chains_failed = False
    torch._dynamo.reset()


def call(fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args), compiled when fused kernels or compiled chains are on."""
    global _failed, _chains_failed
    if not compiling():
        return fn(*args)
    compiled = _compiled.get(fn)
    if compiled is None:
        # emulate_precision_casts keeps eager's intermediate roundings (e.g. the bf16 cast before the norm
        # weight), so the engine's numbers stay those of the trainer's eager forward.
        compiled = _compiled[fn] = torch.compile(
            fn, dynamic=True, fullgraph=True, options={"emulate_precision_casts": True}
        )
    try:
        return compiled(*args)
    except Exception as err:
        # An error of the inputs raises from the eager function too (and fusion stays on); one that only the
        # compiled path has (no Triton, no compiler) switches to the eager kernels, which give the same results.
        result = fn(*args)
        if _enabled:
            _failed = True
        else:
            _chains_failed = True
        log.warning("fused kernels unavailable (%s: %s); running the eager ones", type(err).__name__, err)
        return result


@dataclass
class KernelSwitch:
    """On/off state of a hand-written Triton kernel. The first error it raises (other than running out of
    memory, which is the caller's to handle) turns it off for the rest of the process with one warning, and
    its callers run the compiled or eager function that computes the same thing instead."""

    name: str
    fallback: str
    logger: logging.Logger = log
    """The kernel module's own, so its warning can be filtered like its other messages."""
    on: bool = True

    def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T | None:
        """fn(*args, **kwargs), or None once the kernel has failed (now or before)."""
        if not self.on:
            return None
        try:
            return fn(*args, **kwargs)
        except torch.cuda.OutOfMemoryError:
            raise
        except Exception as err:  # e.g. no Triton compiler here
            self.on = False
            self.logger.warning(
                "%s unavailable (%s: %s); %s", self.name, type(err).__name__, err, self.fallback
            )
            return None
