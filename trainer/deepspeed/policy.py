"""`trainer.backend=deepspeed`: our `CausalLM` trained by a DeepSpeed ZeRO engine over the data-parallel ranks.

`DeepSpeedPolicy` is the module `PolicyTrainer` trains (a copy of the engine's model, as with megatron); its
`start()` builds the DeepSpeed engine and returns the `ZeroStep` the trainer hands backward, optimizer step
and optimizer state to. The LM head runs inside the engine's forward (`_LogprobsModule`), so ZeRO-3 gathers
its weight there; each decoder layer is a ZeRO-3 leaf (its weights gathered together, one layer at a time).

The weight sync reads `iter_engine_weights()`: with ZeRO-3 one layer's (or one top-level tensor's) shards
gathered at a time (`GatheredParameters`, a collective of every rank) and copied out, never the whole model.
"""

from __future__ import annotations

import copy
import logging
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from miles.config import TrainerConfig
from miles.distributed import SINGLE, DataParallel
from miles.errors import MilesUserError
from miles.models import CausalLM
from miles.trainer.deepspeed.config import check_deepspeed_settings, deepspeed_config
from miles.trainer.deepspeed.safe_loading import check_loadable, restrict_checkpoint_loading
from miles.trainer.logprobs import TokenLogprobs, packed_logprobs
from miles.trainer.optim import build_optimizer, set_lr
from miles.trainer.packing import MicroBatch, pack

logger = logging.getLogger(__name__)

CHECKPOINT_DIR = "deepspeed"
"""A checkpoint's folder of DeepSpeed's sharded state (every rank's optimizer and weight shards)."""


class _LogprobsModule(nn.Module):
    """The engine's module: a packed micro-batch's response logprobs (and entropy), LM head included."""

    def __init__(self, lm: CausalLM) -> None:
        super().__init__()
        self.lm = lm

    def forward(
        self,
        batch: MicroBatch,
        temperature: float,
        precision: str,
        with_entropy: bool,
        entropy_grad: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        out = packed_logprobs(self.lm, batch, temperature, precision, with_entropy, entropy_grad)
        return out.logprobs, out.entropy  # a tuple: ZeRO-3 hooks the backward through its tensors


class DeepSpeedPolicy(nn.Module):
    """A `CausalLM` trained by DeepSpeed; reads like the model to the trainer (forward, args, device)."""

    def __init__(self, model: CausalLM) -> None:
        super().__init__()
        self.wrapped = _LogprobsModule(copy.deepcopy(model))
        self.args = model.args
        self.__dict__["engine"] = None  # not a submodule: its parameters are `wrapped`'s
        self.zero_stage = 0

    @property
    def lm(self) -> CausalLM:
        return self.wrapped.lm

    @property
    def device(self) -> torch.device:
        return self.lm.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm.dtype

    def start(self, cfg: TrainerConfig, dp: DataParallel = SINGLE) -> ZeroStep:
        """Build the DeepSpeed engine over `dp`'s ranks (all of them call this) and return the step it runs."""
        check_deepspeed_settings(cfg)
        deepspeed = import_deepspeed(self.device)
        if dp.group is not None:
            raise ValueError("the deepspeed backend runs over the whole world's data-parallel group")
        join_process_group(deepspeed, dp, self.device)
        bf16 = self.dtype == torch.bfloat16
        config = deepspeed_config(cfg, bf16, dp.world_size)
        if cfg.zero_stage == 3:
            from deepspeed.utils import set_z3_leaf_modules

            set_z3_leaf_modules(self.lm, [type(self.lm.model.layers[0])])
        params = [p for p in self.wrapped.parameters() if p.requires_grad]
        optimizer = build_optimizer(params, cfg)
        if cfg.offload_optimizer != "none":
            # The step runs on host float32 shards: torch's fused CPU AdamW (~6x its per-op form), so no
            # DeepSpeed CPU-Adam build is needed.
            for group in [*optimizer.param_groups, optimizer.defaults]:
                group["fused"], group["foreach"] = True, None
        engine, _, _, _ = deepspeed.initialize(
            model=self.wrapped, optimizer=optimizer, config=config, dist_init_required=False
        )
        restrict_checkpoint_loading(engine)  # shard files load weights-only, never as arbitrary pickles
        self.__dict__["engine"] = engine
        self.zero_stage = cfg.zero_stage
        if cfg.zero_stage == 3:  # used outside their modules' forward: gathered for the whole engine forward
            deepspeed.zero.register_external_parameter(self.wrapped, self.lm.lm_head.weight)
            deepspeed.zero.register_external_parameter(self.wrapped, self.lm.model.norm.weight)
        return ZeroStep(engine, dp)

    # ---- the forward the trainer runs ----------------------------------------------------------------

    def packed_logprobs(
        self,
        batch: MicroBatch,
        temperature: float,
        precision: str,
        with_entropy: bool,
        entropy_grad: bool,
    ) -> TokenLogprobs:
        run = self.engine if self.engine is not None else self.wrapped
        logprobs, entropy = run(batch, temperature, precision, with_entropy, entropy_grad)
        return TokenLogprobs(logprobs=logprobs, entropy=entropy)

    # ---- weights out and in -------------------------------------------------------------------------

    def iter_engine_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The whole weights in the engine model's names. ZeRO-3: a collective of every rank, one layer (or
        one top-level tensor) gathered at a time and copied out; stages 1-2 hold whole weights already."""
        if self.zero_stage != 3:
            for name, param in self.lm.named_parameters():
                yield name, param.detach()
            return
        for names, params in _gather_units(self.lm):
            with _gathered(params):
                copies = [p.detach().clone() for p in params]
            yield from zip(names, copies)

    def engine_weights(self) -> list[tuple[str, torch.Tensor]]:
        return list(self.iter_engine_weights())

    @torch.no_grad()
    def load_from(self, model: CausalLM) -> None:
        """Take `model`'s weights (every rank passes the same), and the float32 masters from them."""
        source = dict(model.named_parameters())
        if self.zero_stage != 3:
            for name, param in self.lm.named_parameters():
                param.copy_(source[name])
        else:
            for names, params in _gather_units(self.lm):
                with _gathered(params, modifier_rank=0):
                    for name, param in zip(names, params):
                        param.copy_(source[name])
        if self.engine is not None:
            self.engine.optimizer._restore_from_bit16_weights()


class ZeroStep:
    """What `PolicyTrainer` hands to DeepSpeed: backward passes, the optimizer step and its state.

    Every rank runs the same number of passes per optimizer step (ZeRO-2/3 reduce gradients in every
    backward, ZeRO-3 gathers weights in every forward): a rank with fewer micro-batches runs zero-weight
    passes on a 2-token batch. DeepSpeed averages gradients over the ranks; the trainer's losses are already
    normalized by the whole batch, so each loss is scaled by the world size to sum them instead."""

    def __init__(self, engine: Any, dp: DataParallel) -> None:
        self.engine, self.dp = engine, dp

    def passes(self, mine: int) -> int:
        """The forward/backward passes every rank runs when this rank has `mine` micro-batches."""
        return int(self.dp.all_reduce_floats([mine], "max")[0])

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss * self.dp.world_size, scale_wrt_gas=False)

    def pad_backward(
        self, done: int, passes: int, model: DeepSpeedPolicy, precision: str, entropy_grad: bool
    ) -> None:
        """Zero-weight forward/backward passes up to `passes` (a rank short of micro-batches). They run the
        real passes' graph (the entropy's gradient too when those have it): ZeRO-3 replays one recorded
        module order on every rank, and a rank whose order differs would wait on collectives forever."""
        for _ in range(done, passes):
            out = model.packed_logprobs(_filler(model.device), 1.0, precision, True, entropy_grad)
            loss = out.logprobs.sum() + (out.entropy.sum() if entropy_grad else 0.0)
            self.backward(loss * 0.0)

    def pad_forward(self, done: int, model: DeepSpeedPolicy, precision: str) -> None:
        """No-grad forwards up to every rank's count (ZeRO-3 gathers weights in each forward, collectively)."""
        for _ in range(done, self.passes(done)):
            model.packed_logprobs(_filler(model.device), 1.0, precision, False, False)

    def apply_update(self, skip: bool, lr: float) -> dict[str, float]:
        """DeepSpeed's optimizer step at `lr` (clipped, its gradients reduced), or none when `skip`."""
        set_lr(self.engine.optimizer, lr)
        if skip:  # no loss tokens anywhere: drop the (zero) gradients without touching the moments
            self._drop_gradients()
            return {"train/grad_norm": 0.0, "train/lr": lr, "train/skipped_steps": 1.0}
        skipped_before = self.engine.skipped_steps
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        grad_norm = float(norm) if norm is not None else float("nan")
        skipped = self.engine.skipped_steps > skipped_before or not math.isfinite(grad_norm)
        if skipped:
            logger.warning("skipping an optimizer step (grad norm %s)", grad_norm)
        return {"train/grad_norm": grad_norm, "train/lr": lr, "train/skipped_steps": float(skipped)}

    def _drop_gradients(self) -> None:
        # step() with a zero-gradient boundary would still advance AdamW's moments; clear instead.
        optimizer = self.engine.optimizer
        if hasattr(optimizer, "zero_grad"):
            optimizer.zero_grad(set_to_none=True)
        self.engine.zero_grad()
        self.engine._unmanaged_backward_count = 0

    def memory_reserve_bytes(self) -> int:
        """Device bytes of the gradients an update adds (bf16/fp32 weights' size, this rank's share with
        ZeRO-2/3); the optimizer state DeepSpeed allocated at start is held already."""
        module = self.engine.module
        total = sum(
            getattr(p, "ds_numel", p.numel()) * p.element_size()
            for p in module.parameters()
            if p.requires_grad and p.device.type == "cuda"
        )
        stage = self.engine.zero_optimization_stage()
        return total // self.dp.world_size if stage >= 2 else total

    # ---- sharded checkpoints ------------------------------------------------------------------------

    @staticmethod
    def schedule_meta(trainer: Any) -> dict[str, Any]:
        """The trainer's part of a checkpoint (the schedule's position; the shards are DeepSpeed's)."""
        return {
            "optimizer": "deepspeed",
            "optimizer_steps_done": trainer.optimizer_steps_done,
            "total_optimizer_steps": trainer.total_optimizer_steps,
        }

    @staticmethod
    def load_schedule_meta(trainer: Any, meta: dict[str, Any]) -> None:
        """The schedule's position; refused where the checkpoint's optimizer state is not DeepSpeed's or
        the trainer is not the deepspeed backend (either way the state would not fit)."""
        if meta.get("optimizer") != "deepspeed" or trainer.zero is None:
            raise MilesUserError(
                "this checkpoint's optimizer state and this run's trainer.backend disagree (one is "
                "deepspeed, the other not); resume it with the backend that wrote it"
            )
        trainer.optimizer_steps_done = int(meta["optimizer_steps_done"])
        total = meta.get("total_optimizer_steps")
        trainer.total_optimizer_steps = None if total is None else int(total)

    def stage(self, checkpoints: Path, step: int) -> Path:
        """Every rank's shards of step `step` into a staging folder under `checkpoints` (a collective);
        rank 0 then moves it into the checkpoint (`CHECKPOINT_DIR`), which becomes whole in one rename."""
        import shutil

        staging = checkpoints / f".deepspeed_step_{step:06d}.tmp"
        if self.dp.is_main:  # what an earlier save cut short left behind
            checkpoints.mkdir(parents=True, exist_ok=True)
            for stale in checkpoints.glob(".deepspeed_step_*.tmp"):
                shutil.rmtree(stale, ignore_errors=True)
        self.dp.barrier()
        self.save(staging)
        return staging

    def save(self, folder: Path) -> None:
        """DeepSpeed's sharded state into `folder` (a collective: every rank writes its own shard files)."""
        self.engine.save_checkpoint(str(folder), tag="state", save_latest=False)
        self.dp.barrier()

    def load(self, folder: Path) -> None:
        """The weights, float32 masters and optimizer shards `save` wrote (a collective), each file read
        weights-only (`safe_loading`): a file holding anything else is refused with a `MilesUserError`."""
        if not (folder / "state").is_dir():
            raise MilesUserError(
                f"{folder} holds no DeepSpeed state (state/): the checkpoint was not written by a run with "
                "trainer.backend=deepspeed; resume it with the backend that wrote it"
            )
        check_loadable(self.engine, folder / "state")
        path, _ = self.engine.load_checkpoint(
            str(folder), tag="state", load_optimizer_states=True, load_lr_scheduler_states=False
        )
        if path is None:
            raise RuntimeError(f"DeepSpeed could not load its state from {folder}")


def _filler(device: torch.device) -> MicroBatch:
    """A 2-token micro-batch (one prompt token, one response token) for the zero-weight passes."""
    from miles.sample import Sample

    return pack([Sample(prompt_ids=[0], response_ids=[0])], [0], 16, device)[0]


def _gather_units(lm: CausalLM) -> Iterator[tuple[list[str], list[nn.Parameter]]]:
    """The weights in gather units: each decoder layer's together, every other tensor alone."""
    layer_prefix = "model.layers."
    units: dict[str, tuple[list[str], list[nn.Parameter]]] = {}
    for name, param in lm.named_parameters():
        key = ".".join(name.split(".")[:3]) if name.startswith(layer_prefix) else name
        names, params = units.setdefault(key, ([], []))
        names.append(name)
        params.append(param)
    yield from units.values()


def _gathered(params: list[nn.Parameter], modifier_rank: int | None = None) -> Any:
    import deepspeed

    return deepspeed.zero.GatheredParameters(params, modifier_rank=modifier_rank)


def import_deepspeed(device: torch.device) -> Any:
    """deepspeed, for `device`'s accelerator. On CPU its shared-memory all-reduce op (a C++ build of ~70 s at
    first use, used only by inference tensor parallelism) is marked unavailable, so training never builds it;
    gloo carries the collectives."""
    if device.type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import deepspeed
    except ImportError as err:
        raise MilesUserError(
            "trainer.backend=deepspeed needs DeepSpeed: pip install -e '.[deepspeed]'"
        ) from err
    if device.type == "cpu":
        from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder

        deepspeed.ops.__compatible_ops__[ShareMemCommBuilder.NAME] = False
    return deepspeed


def join_process_group(deepspeed: Any, dp: DataParallel, device: torch.device) -> None:
    """DeepSpeed's communication backend over the process group the launcher (or torchrun, or the Ray
    placement) already made; with one process, a group of one. No MPI discovery, no variables to set by hand."""
    import torch.distributed as dist

    if not dist.is_initialized():  # one process: DeepSpeed still wants a group
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=0,
            world_size=1,
        )
    # DeepSpeed reads these (its own checks) though the group exists; they describe the group we joined.
    os.environ["RANK"] = str(dist.get_rank())
    os.environ["WORLD_SIZE"] = str(dist.get_world_size())
    os.environ["LOCAL_RANK"] = str(dp.local_rank)
    deepspeed.init_distributed(
        dist_backend=dist.get_backend(), auto_mpi_discovery=False, dist_init_required=False
    )
