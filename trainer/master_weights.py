"""Float32 master weights for a 16-bit policy (`trainer.master_weights`).

With `model.dtype=bfloat16` the engine and the trainer run the same bf16 module, and AdamW updating those
bf16 weights in place loses every update smaller than a weight's rounding step (~0.4 % of it): at an RL
learning rate of 1e-6 most of them. Here the optimizer updates float32 copies instead, the gradients of each
micro-batch are summed into float32 buffers as autograd produces them (the bf16 gradient is then dropped),
and after every optimizer step the copies are rounded into the model, which is what the engine samples from
next. Megatron's mixed-precision optimizer and verl's FSDP default keep float32 masters the same way.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

SIXTEEN_BIT = (torch.bfloat16, torch.float16)


def wants_master_weights(model: nn.Module, enabled: bool) -> bool:
    """Whether the trainable parameters are 16-bit and master weights are asked for."""
    return enabled and any(p.requires_grad and p.dtype in SIXTEEN_BIT for p in model.parameters())


class MasterWeights:
    """Float32 copies of a model's trainable parameters, holding the gradients and taking the updates."""

    def __init__(self, model: nn.Module) -> None:
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        # A float32 parameter (a bf16 model may keep some in float32) is its own master.
        self.masters = [p if p.dtype == torch.float32 else p.detach().float().clone() for p in self.params]
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._folder(master))
            for p, master in zip(self.params, self.masters)
            if master is not p
        ]

    @staticmethod
    def _folder(master: torch.Tensor):  # noqa: ANN205 - a hook closure
        def fold(param: torch.Tensor) -> None:
            # Summed in float32 as each micro-batch's gradient arrives, so the bf16 one lives only briefly.
            if param.grad is None:  # another hook on the parameter took it already
                return
            if master.grad is None:
                master.grad = param.grad.float()  # type: ignore[union-attr]
            else:
                master.grad.add_(param.grad)  # type: ignore[arg-type]
            param.grad = None

        return fold

    def named_masters(self) -> Iterator[tuple[str, torch.Tensor]]:
        return zip(self.names, self.masters)

    @torch.no_grad()
    def copy_to_model(self) -> None:
        """Round the float32 weights into the model (nearest), after an optimizer step."""
        # One multi-tensor copy instead of a launch per parameter (a small model has hundreds).
        pairs = [(param, master) for param, master in zip(self.params, self.masters) if master is not param]
        if pairs:
            torch._foreach_copy_([p for p, _ in pairs], [m for _, m in pairs])

    @torch.no_grad()
    def copy_from_model(self) -> None:
        """Take the model's weights (they were loaded from elsewhere, e.g. a checkpoint without masters)."""
        for param, master in zip(self.params, self.masters):
            if master is not param:
                master.copy_(param)

    def remove_hooks(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
