"""`PolicyTrainer`: one RL or SFT update of the policy module a backend built (our `CausalLM` for `torch`, a
megatron-core GPTModel for `megatron`): AdamW, packed micro-batches, gradient accumulation.

One `train_step(samples)` is one RL update on a scored rollout batch:
  1. recompute the logprobs of the rollout tokens under the current weights (no grad): the PPO "old"
     logprobs, and the `mismatch/*` metrics against the engine's own logprobs (when the whole batch is one
     optimizer step of one epoch, the training forward itself runs on those weights, so its detached
     logprobs are the old logprobs and no separate pass runs);
  2. reference-model logprobs when `kl_coef > 0`;
  3. `epochs_per_rollout` passes, each split into optimizer steps of `global_batch_size` samples, each step
     accumulated over packed micro-batches of at most `micro_batch_tokens` tokens.

With data parallelism (`dp`, miles/distributed/) each rank holds a replica and trains on its own share of
the batch: the batch is ordered by (group, index) across ranks so each optimizer step holds one process's
samples, the loss denominators are the whole batch's, the gradients are summed across ranks before each
optimizer step, and the metrics are the whole batch's, so the replicas apply the one update a single process
would (up to the order of float additions) and stay identical.
"""

from __future__ import annotations

import logging
import math
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from miles.config import AlgorithmConfig, TrainerConfig
from miles.distributed import SINGLE, DataParallel
from miles.models import CausalLM, fused
from miles.sample import Sample
from miles.trainer.algorithms import PolicyLossFn, get_policy_loss
from miles.trainer.deepspeed.policy import DeepSpeedPolicy, ZeroStep
from miles.trainer.distributed_optimizer.trainer import (
    build_sharded_optimizer,
    check_optimizer_kind,
    load_sharded_state_dict,
    sharded_state_dict,
    sharded_update,
)
from miles.trainer.kl import KL_ESTIMATORS, kl_estimate
from miles.trainer.logprobs import autocast, packed_logprobs, use_fused_kernels
from miles.trainer.losses import LossNormalizer, PolicyLossInput
from miles.trainer.master_weights import MasterWeights, wants_master_weights
from miles.trainer.mfu import device_peak_flops, forward_flops
from miles.trainer.mismatch import mismatch_metrics, rows_on_device, tis_weights
from miles.trainer.model_parallel import clip_split_gradients, gradient_sets, is_filler, lockstep_batches
from miles.trainer.optim import build_optimizer, lr_multiplier, set_lr
from miles.trainer.packing import MicroBatch, fed_length, pack, response_loss_mask, validate_sample
from miles.trainer.recompute import apply_recompute

logger = logging.getLogger(__name__)


@dataclass
class TokenData:
    """Per-sample tensors [response_len] fixed before the update (indexed by position in the batch)."""

    loss_mask: list[torch.Tensor]
    old_logprobs: list[torch.Tensor] | None
    """None: on-policy, the detached logprobs of the training forward itself are the old logprobs."""
    ref_logprobs: list[torch.Tensor] | None = None
    tis_weights: list[torch.Tensor] | None = None
    rollout_logprobs: list[torch.Tensor | None] | None = None
    """Engine logprobs, used for TIS inside the training forward when `old_logprobs` is None."""
    tis_cap: float | None = None
    """TIS cap when TIS is on and the weights are computed inside the training forward."""
    recorded_old: dict[int, torch.Tensor] = field(default_factory=dict)
    """On-policy: the old logprobs the training forward produced, for the mismatch metrics."""


FLOAT16_REFUSED = (
    "model.dtype=float16 cannot be trained here (the trainer has no loss scaling, and float16 gradients "
    "underflow without it); use model.dtype=bfloat16"
)


class PolicyTrainer:
    def __init__(
        self,
        model: CausalLM,
        cfg: TrainerConfig,
        algorithm: AlgorithmConfig,
        temperature: float,
        ref_model: CausalLM | None = None,
        total_optimizer_steps: int | None = None,
        dp: DataParallel = SINGLE,
    ) -> None:
        """`temperature` is the rollout sampling temperature (logprobs use logits / temperature).

        `total_optimizer_steps` sizes the cosine schedule; when None it is set on the first call to
        `max_steps * optimizer steps per call` (see `set_total_optimizer_steps`). With `dp` every rank
        calls each step with its own samples (possibly none), and all of them must call it.
        """
        if algorithm.kl_coef > 0 and ref_model is None:
            raise ValueError(
                "algorithm.kl_coef > 0 needs a frozen reference model: pass ref_model= (or set kl_coef=0)"
            )
        if algorithm.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(
                f"unknown algorithm.kl_estimator {algorithm.kl_estimator!r}; use {', '.join(KL_ESTIMATORS)}"
            )
        LossNormalizer(algorithm.loss_agg, 0, 0)  # validates the aggregation name at start
        autocast(model.device, cfg.precision)  # validates the precision name at start
        if cfg.global_batch_size <= 0 or cfg.epochs_per_rollout <= 0:
            raise ValueError("trainer.global_batch_size and trainer.epochs_per_rollout must be positive")
        self.model, self.cfg, self.algorithm, self.ref_model = model, cfg, algorithm, ref_model
        self.temperature = temperature
        self.dp = dp
        self.world = dp
        """Every rank of the run (`dp` before it is narrowed to the replicas' group under tensor parallelism)."""
        self.tp = SINGLE
        """The ranks that hold the other parts of this replica (megatron tensor parallelism): they train on
        the same samples, the union of theirs; `dp` is then the replicas' group, across which gradients sum."""
        tp_group = getattr(model, "tensor_parallel_group", None)
        if tp_group is not None:
            self.tp = dp.within(tp_group)
            self.dp = dp.within(model.data_parallel_group)
        self.model_parallel = self.tp.enabled or getattr(model, "expert_group", None) is not None
        """Some parameters are split over ranks (TP, or experts over EP x expert-TP; trainer/model_parallel.py)."""
        self.device = model.device
        self.policy_loss = get_policy_loss(algorithm.policy_loss)
        self.sft_loss = get_policy_loss("sft")
        if any(p.requires_grad and p.dtype == torch.float16 for p in model.parameters()):
            raise ValueError(FLOAT16_REFUSED)
        apply_recompute(model, cfg.recompute)
        self.sharded = build_sharded_optimizer(model, cfg, self.dp, self.world)
        """`trainer.distributed_optimizer`: masters, moments and reduced gradients split over the data-parallel
        ranks (trainer/distributed_optimizer/adamw.py); the replicated AdamW below then holds no state."""
        self.zero = model.start(cfg, self.dp) if isinstance(model, DeepSpeedPolicy) else None
        """`trainer.backend=deepspeed`: DeepSpeed runs the backward, the step and keeps the optimizer state
        (trainer/deepspeed/policy.py); the AdamW below then holds none."""
        wants_masters = (
            self.sharded is None and self.zero is None and wants_master_weights(model, cfg.master_weights)
        )
        self.masters = MasterWeights(model) if wants_masters else None
        """Float32 copies of a bf16 model's weights, which the optimizer updates (trainer/master_weights.py)."""
        trainable = (
            list(self.masters.named_masters())
            if self.masters is not None
            else [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        )
        self._names = {id(t): name for name, t in trainable}
        """The parameter name of each tensor the optimizer updates."""
        self.optimizer = build_optimizer([t for _, t in trainable], cfg)
        self.total_optimizer_steps = total_optimizer_steps
        self._schedule_calls: int | None = None
        """Calls the schedule is sized for from where it stands (`resize_schedule`); None: cfg.max_steps."""
        self.optimizer_steps_done = 0
        self.before_update: list[Callable[[], None]] = []
        """Called once every micro-batch's gradient is in, before the clip and the optimizer step (a probe
        reading the gradients, e.g. miles/bench/memory_parts.py)."""
        # bf16 weights compute in bf16 with or without autocast
        compute = "bf16" if cfg.precision == "bf16" or model.dtype == torch.bfloat16 else "fp32"
        self.peak_flops = device_peak_flops(self.device, compute, cfg.peak_flops)
        # Only our model's forward has the compiled chains (a megatron policy runs megatron's own kernels).
        self.fused_kernels = isinstance(model, CausalLM) and use_fused_kernels(
            cfg.fused_kernels, self.device, compute
        )
        self._warned_missing_logprobs = False

    def set_total_optimizer_steps(self, total: int) -> None:
        self.total_optimizer_steps = int(total)

    def resize_schedule(self, calls_left: int) -> None:
        """Size the cosine schedule again at the next call, to end after `calls_left` more calls (a resumed
        run whose length, batch size or epochs changed): the optimizer steps taken so far, plus `calls_left`
        times the steps a call then takes."""
        self.total_optimizer_steps, self._schedule_calls = None, max(1, int(calls_left))

    def _size_schedule(self, steps_per_call: int) -> None:
        if self.total_optimizer_steps is None:
            calls = self.cfg.max_steps if self._schedule_calls is None else self._schedule_calls
            self.total_optimizer_steps = self.optimizer_steps_done + calls * steps_per_call

    # ---- public steps -------------------------------------------------------------------------------

    def train_step(self, samples: list[Sample]) -> dict[str, float]:
        """One RL update on scored samples (with `advantage` set). Returns `train/*` and `mismatch/*`."""
        if self.temperature <= 0:
            raise ValueError(
                f"RL training needs a sampling temperature > 0 (got {self.temperature}); greedy rollouts have no logprobs"
            )
        start = time.perf_counter()
        samples = self._tensor_parallel_union(samples)
        for i, sample in enumerate(samples):
            validate_sample(sample, i)
        n = len(samples)
        positions, n_total = self._positions(samples)
        if n_total == 0:
            raise ValueError("train_step got no samples; skip the update when a rollout yields none")
        all_ids = list(range(n))
        masks = rows_on_device([response_loss_mask(s) for s in samples], self.device)
        replay = self.cfg.routing_replay

        gbs, epochs = self.cfg.global_batch_size, self.cfg.epochs_per_rollout
        steps_per_epoch = math.ceil(n_total / gbs)
        self._size_schedule(steps_per_epoch * epochs)
        # One epoch in one optimizer step is on-policy: the training forward runs on the weights the old
        # logprobs would be recomputed with, so its detached logprobs serve as both (one forward saved).
        on_policy = epochs == 1 and steps_per_epoch == 1
        rollout = self._rollout_logprobs(samples)
        tis_cap = self.algorithm.tis_cap if self.algorithm.tis else None
        ref = None
        if self.algorithm.kl_coef > 0:
            ref = self._logprobs_no_grad(self.ref_model, samples, False, self.temperature)
        metrics: dict[str, float] = {}
        if on_policy:
            data = TokenData(masks, None, ref, rollout_logprobs=rollout, tis_cap=tis_cap)
        else:
            old = self._logprobs_no_grad(self.model, samples, replay, self.temperature)
            metrics.update(mismatch_metrics(old, rollout, masks, self.dp))
            tis = None
            if tis_cap is not None:
                tis, tis_metrics = tis_weights(old, rollout, masks, tis_cap, self.dp)
                metrics.update(tis_metrics)
            data = TokenData(masks, old, ref, tis_weights=tis)

        step_metrics = []
        local = {position: i for i, position in enumerate(positions)}
        for epoch in range(epochs):
            # Over the whole batch: each rank takes its own samples of each optimizer step.
            order = self._epoch_order(n_total, epoch) if steps_per_epoch > 1 else list(range(n_total))
            for begin in range(0, n_total, gbs):
                step_metrics.append(
                    self._optimizer_step(
                        samples,
                        [local[g] for g in order[begin : begin + gbs] if g in local],
                        data,
                        self.policy_loss,
                        self.temperature,
                        replay,
                        self.algorithm.entropy_coef,
                    )
                )
        if on_policy:
            old = [data.recorded_old[i] for i in all_ids]
            metrics.update(mismatch_metrics(old, rollout, masks, self.dp))
            if tis_cap is not None:
                metrics.update(tis_weights(old, rollout, masks, tis_cap, self.dp)[1])
        metrics.update(_summarise(step_metrics))
        if ref is None:  # kl_coef = 0: no KL term, even when a reference model was given
            metrics["train/kl"] = 0.0
        # fwd+bwd per epoch, plus the old-logprob and reference forwards
        passes = 3 * epochs + (0 if on_policy else 1) + (1 if ref is not None else 0)
        metrics.update(self._throughput(samples, epochs, passes, time.perf_counter() - start))
        return metrics

    def sft_step(self, samples: list[Sample], temperature: float = 1.0) -> dict[str, float]:
        """One optimizer step of masked NLL over the response tokens of all `samples`, of the logits divided by
        `temperature` (1 for SFT; a draft model trains at the rollout's)."""
        start = time.perf_counter()
        samples = self._tensor_parallel_union(samples)
        for i, sample in enumerate(samples):
            validate_sample(sample, i)
        if self._positions(samples)[1] == 0:
            raise ValueError("sft_step got no samples")
        self._size_schedule(1)
        masks = rows_on_device([response_loss_mask(s) for s in samples], self.device)
        data = TokenData(loss_mask=masks, old_logprobs=None)
        all_ids = list(range(len(samples)))
        step = self._optimizer_step(
            samples, all_ids, data, self.sft_loss, temperature, False, entropy_coef=0.0
        )
        metrics = _summarise([step])
        metrics.update(self._throughput(samples, 1, 3, time.perf_counter() - start))
        return metrics

    @torch.no_grad()
    def logprobs(self, samples: list[Sample], temperature: float | None = None) -> list[torch.Tensor]:
        """Logprobs of each sample's response tokens under the current weights (float32, no grad)."""
        for i, sample in enumerate(samples):
            validate_sample(sample, i)
        t = self.temperature if temperature is None else temperature
        return self._logprobs_no_grad(self.model, samples, self.cfg.routing_replay, t)

    # ---- optimizer and schedule state --------------------------------------------------------------

    @property
    def lr(self) -> float:
        """LR the next optimizer step will use."""
        return self.cfg.lr * lr_multiplier(
            self.optimizer_steps_done, self.cfg.optim, self.total_optimizer_steps
        )

    def state_dict(self) -> dict[str, Any]:
        """{"tensors": {name: tensor} (safetensors-ready), "meta": JSON-able dict} for optimizer + schedule.

        With split parameters (tensor or expert parallelism) a collective of every rank; rank 0 alone keeps the
        whole tensors (the others' "tensors" come back empty). With the distributed optimizer only the schedule and the
        layout: each rank's shards go through miles/rl/sharded_checkpoint.py."""
        if self.sharded is not None:
            return sharded_state_dict(self)
        if self.zero is not None:  # the shards go through DeepSpeed's own checkpoint (ZeroStep.save)
            return {"tensors": {}, "meta": self.zero.schedule_meta(self)}
        keep = self.world.rank == 0
        names = self._names
        saved = self.optimizer.state_dict()
        tensors: dict[str, torch.Tensor] = {}
        scalars: dict[str, Any] = {}
        groups_meta = []
        for group, saved_group in zip(self.optimizer.param_groups, saved["param_groups"]):
            group_names = []
            for param, idx in zip(group["params"], saved_group["params"]):
                name = names[id(param)]
                group_names.append(name)
                for key, value in saved["state"].get(idx, {}).items():
                    if isinstance(value, torch.Tensor):
                        if self.model_parallel and value.shape == param.shape and self.model.is_sharded(name):
                            value = self.model.gather(name, value)  # TP-independent checkpoints
                        if keep:
                            tensors[f"optimizer.{name}.{key}"] = value.detach().to("cpu").contiguous()
                    else:
                        scalars[f"optimizer.{name}.{key}"] = value
            hyper = {
                k: (list(v) if isinstance(v, tuple) else v) for k, v in saved_group.items() if k != "params"
            }
            groups_meta.append({"hyper": hyper, "param_names": group_names})
        if self.masters is not None:  # float32 weights the bf16 model alone cannot give back on resume
            for name, master in self.masters.named_masters():
                if self.model_parallel and self.model.is_sharded(name):
                    master = self.model.gather(name, master)
                if keep:
                    tensors[f"master.{name}"] = master.detach().to("cpu").contiguous()
        meta = {
            "optimizer_steps_done": self.optimizer_steps_done,
            "total_optimizer_steps": self.total_optimizer_steps,
            "param_groups": groups_meta,
            "scalars": scalars,
        }
        return {"tensors": tensors, "meta": meta}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        tensors, meta = state["tensors"], state["meta"]
        if self.zero is not None or meta.get("optimizer") == "deepspeed":  # shards: ZeroStep.load
            return ZeroStep.load_schedule_meta(self, meta)
        check_optimizer_kind(self, meta)
        if self.sharded is not None:
            return load_sharded_state_dict(self, meta)
        current = [[self._names[id(p)] for p in group["params"]] for group in self.optimizer.param_groups]
        saved_names = [g["param_names"] for g in meta["param_groups"]]
        if current != saved_names:
            missing = set(sum(current, [])) ^ set(sum(saved_names, []))
            raise ValueError(
                "optimizer state does not match this model's trainable parameters "
                f"(differs in: {sorted(missing)[:8]}); it was saved for another model or trainer config"
            )
        opt_state: dict[int, dict[str, Any]] = {}
        groups = []
        idx = 0
        for group_meta, current_group in zip(meta["param_groups"], self.optimizer.param_groups):
            indices = []
            for name in group_meta["param_names"]:
                prefix = f"optimizer.{name}."
                entry = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
                if self.model_parallel and self.model.is_sharded(name):
                    entry = {k: self.model.shard(name, v) if v.dim() else v for k, v in entry.items()}
                entry.update(
                    {k[len(prefix) :]: v for k, v in meta["scalars"].items() if k.startswith(prefix)}
                )
                if entry:
                    opt_state[idx] = entry
                indices.append(idx)
                idx += 1
            # The checkpoint gives the per-parameter state (moments, step counts); the group's
            # hyper-parameters (weight_decay, betas, eps, ...) and how the update is computed (a GPU run's
            # fused kernel may resume on a CPU) come from this run's config, so a setting changed for the
            # resume takes effect (lr is re-applied each step anyway).
            hyper = {k: v for k, v in current_group.items() if k != "params"}
            groups.append({**hyper, "params": indices})
        self.optimizer.load_state_dict({"state": opt_state, "param_groups": groups})
        self._load_masters(tensors)
        self.optimizer_steps_done = int(meta["optimizer_steps_done"])
        total = meta.get("total_optimizer_steps")
        self.total_optimizer_steps = None if total is None else int(total)

    @torch.no_grad()
    def _load_masters(self, tensors: dict[str, torch.Tensor]) -> None:
        """The saved float32 weights where the checkpoint has them (a bf16 run's, into the masters or, resumed
        in float32, into the weights themselves); else the masters take the model's (just loaded) own."""
        if self.masters is not None:
            self.masters.copy_from_model()
        for group in self.optimizer.param_groups:
            for master in group["params"]:
                name = self._names[id(master)]
                self._load_master(name, master, tensors.get(f"master.{name}"))
        if self.masters is not None:
            self.masters.copy_to_model()

    def _load_master(self, name: str, master: torch.Tensor, saved: torch.Tensor | None) -> None:
        if saved is None or master.dtype != torch.float32:
            return
        if self.model_parallel and self.model.is_sharded(name):
            saved = self.model.shard(name, saved)
        if saved.shape != master.shape:
            raise ValueError(
                f"the checkpoint's master weight {name} has shape {tuple(saved.shape)}, the model's "
                f"{tuple(master.shape)}: it was saved for another model"
            )
        master.copy_(saved)

    def memory_reserve_bytes(self) -> int:
        """Device bytes the trainer will allocate beyond what it holds now: the gradients of an update and,
        before the first one, AdamW's two moments. A colocated engine sizes its KV pool without them. An
        estimate: it counts experts no token may reach, and leaves out short-lived buffers (a gradient's
        float32 copy as it is folded in, an all-reduce bucket), which the pool's fraction leaves room for."""
        if self.sharded is not None:  # its slices are allocated already: the update adds the gradients
            return self.sharded.grad_bytes() if self.device.type == "cuda" else 0
        if self.zero is not None:
            return self.zero.memory_reserve_bytes()
        total = 0
        for group in self.optimizer.param_groups:
            for tensor in group["params"]:
                if tensor.device.type != "cuda":
                    continue
                nbytes = tensor.numel() * tensor.element_size()
                total += nbytes if self.optimizer.state.get(tensor) else 3 * nbytes
        return total

    def _named_grads(self) -> list[tuple[str, torch.Tensor]]:
        """The gradients the optimizer steps on (the master weights' float32 ones, or the model's), by name."""
        return [
            (self._names[id(t)], t.grad)
            for group in self.optimizer.param_groups
            for t in group["params"]
            if t.grad is not None
        ]

    # ---- internals ---------------------------------------------------------------------------------

    def _epoch_order(self, n: int, epoch: int) -> list[int]:
        # Seeded by the schedule position, so a resumed run shuffles exactly as an uninterrupted one.
        generator = torch.Generator().manual_seed(
            self.cfg.seed * 1_000_003 + self.optimizer_steps_done + epoch
        )
        return torch.randperm(n, generator=generator).tolist()

    @torch.no_grad()
    def _logprobs_no_grad(
        self, model: CausalLM, samples: list[Sample], replay: bool, temperature: float
    ) -> list[torch.Tensor]:
        result: list[torch.Tensor] = [torch.empty(0)] * len(samples)
        ids = list(range(len(samples)))
        batches = pack(samples, ids, self.cfg.micro_batch_tokens, self.device, replay)
        for batch in lockstep_batches(model, batches, self.world, self.device, replay):
            out = packed_logprobs(
                model, batch, temperature, self.cfg.precision, fused_kernels=self.fused_kernels
            )
            if is_filler(batch):
                continue
            for i, values in zip(batch.sample_ids, batch.per_sample(out.logprobs)):
                result[i] = values
        if self.zero is not None and model is self.model:  # every rank runs as many forwards (ZeRO-3)
            self.zero.pad_forward(len(batches), self.model, self.cfg.precision)
        return result

    def _rollout_logprobs(self, samples: list[Sample]) -> list[torch.Tensor | None]:
        given = [s for s in samples if s.rollout_logprobs]
        on_device = iter(rows_on_device([s.rollout_logprobs for s in given], self.device))
        rollout = [next(on_device) if s.rollout_logprobs else None for s in samples]
        if any(r is None for r in rollout) and not self._warned_missing_logprobs:
            self._warned_missing_logprobs = True
            logger.warning(
                "%d of %d samples carry no rollout_logprobs: mismatch metrics and TIS skip them",
                sum(r is None for r in rollout),
                len(samples),
            )
        return rollout

    def _optimizer_step(
        self,
        samples: list[Sample],
        ids: list[int],
        data: TokenData,
        loss_fn: PolicyLossFn,
        temperature: float,
        replay: bool,
        entropy_coef: float,
    ) -> dict[str, float]:
        algo = self.algorithm
        normalizer = LossNormalizer.from_masks(algo.loss_agg, [data.loss_mask[i] for i in ids])
        if self.dp.enabled:  # the aggregation's denominators are the whole batch's, over every rank
            tokens, seqs = self.dp.all_reduce_floats([normalizer.num_tokens, normalizer.num_seqs])
            normalizer = LossNormalizer(algo.loss_agg, int(tokens), int(seqs))
        step = (samples, ids, data, loss_fn, temperature, replay, entropy_coef, normalizer)
        try:
            sums = self._accumulate_gradients(*step)
        except torch.cuda.OutOfMemoryError:
            raise
        except Exception as err:
            if not self.fused_kernels:
                raise
            # A compiled backward is built lazily inside `loss.backward()`, where the forward's eager fallback
            # (fused.call) cannot catch its failure; no update has been applied yet, so the step is redone
            # with the eager chains, which compute the same.
            fused.disable_chains(f"{type(err).__name__}: {err}")
            self.fused_kernels = False
            sums = self._accumulate_gradients(*step)
        # One host sync for all the sums (an .item() each would wait once per metric).
        values = torch.stack(list(sums.values())).tolist() if sums else []
        metrics = self._sum_over_ranks(dict(zip(sums, values)))
        for hook in self.before_update:
            hook()
        metrics.update(self._apply_update(skip=normalizer.num_tokens == 0))
        return metrics

    def _accumulate_gradients(
        self,
        samples: list[Sample],
        ids: list[int],
        data: TokenData,
        loss_fn: PolicyLossFn,
        temperature: float,
        replay: bool,
        entropy_coef: float,
        normalizer: LossNormalizer,
    ) -> dict[str, torch.Tensor]:
        """Gradients of one optimizer step's loss over its micro-batches (from zero), and the metric sums."""
        algo = self.algorithm
        self.optimizer.zero_grad(set_to_none=True)
        if self.sharded is not None:
            self.sharded.zero_grad()
        # a failed pass (the eager retry) may have left some behind
        if self.masters is not None or self.sharded is not None:
            self.model.zero_grad(set_to_none=True)
        sums: dict[str, torch.Tensor] = defaultdict(lambda: torch.zeros((), device=self.device))
        batches = pack(samples, ids, self.cfg.micro_batch_tokens, self.device, replay)
        passes = self.zero.passes(len(batches)) if self.zero is not None else len(batches)
        for batch in lockstep_batches(self.model, batches, self.world, self.device, replay):
            out = packed_logprobs(
                self.model,
                batch,
                temperature,
                self.cfg.precision,
                with_entropy=True,
                entropy_grad=entropy_coef > 0,
                fused_kernels=self.fused_kernels,
            )
            if is_filler(batch):  # this rank's part in the experts' collectives, forward and backward
                (out.logprobs.sum() * 0.0).backward()
                continue
            ids_in = batch.sample_ids
            mask = torch.cat([data.loss_mask[i] for i in ids_in])
            lengths = torch.tensor(batch.response_lengths, device=self.device)
            advantages = torch.tensor([float(samples[i].advantage) for i in ids_in], device=self.device)
            old, tis = self._old_and_tis(data, batch, out.logprobs)
            loss_input = PolicyLossInput(
                logprobs=out.logprobs,
                old_logprobs=old,
                advantages=advantages.repeat_interleave(lengths),
                loss_mask=mask,
                seq_index=batch.seq_index,
                num_seqs=len(ids_in),
                tis_weights=tis,
            )
            result = loss_fn(loss_input, algo)
            weights = normalizer.token_weights(mask, batch.seq_index, len(ids_in))
            pg_loss = (result.token_loss * weights).sum()
            loss = pg_loss
            mean_weights = mask / max(normalizer.num_tokens, 1)  # metrics are token means over the batch
            if data.ref_logprobs is not None:
                kl = kl_estimate(
                    out.logprobs, torch.cat([data.ref_logprobs[i] for i in ids_in]), algo.kl_estimator
                )
                loss = loss + algo.kl_coef * (kl * weights).sum()
                sums["train/kl"] += (kl.detach() * mean_weights).sum()
            if entropy_coef > 0:
                loss = loss - entropy_coef * (out.entropy * weights).sum()
            if self.zero is not None:
                self.zero.backward(loss)
            else:
                loss.backward()
            sums["train/loss"] += loss.detach()
            sums["train/pg_loss"] += pg_loss.detach()
            sums["train/entropy"] += (out.entropy.detach() * mean_weights).sum()
            sums["train/nll"] += (-out.logprobs.detach() * mean_weights).sum()
            for name, values in result.token_metrics.items():
                sums[name] += (values.detach().float() * mean_weights).sum()
        if self.zero is not None:  # every rank runs as many passes (DeepSpeed's collectives)
            self.zero.pad_backward(len(batches), passes, self.model, self.cfg.precision, entropy_coef > 0)
        return sums

    def _old_and_tis(
        self, data: TokenData, batch: MicroBatch, logprobs: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Old logprobs and TIS weights [M] for a micro-batch: precomputed, or from this forward (on-policy)."""
        ids = batch.sample_ids
        if data.old_logprobs is not None:
            old = torch.cat([data.old_logprobs[i] for i in ids])
            return old, None if data.tis_weights is None else torch.cat([data.tis_weights[i] for i in ids])
        old = logprobs.detach()
        per_sample = batch.per_sample(old)
        data.recorded_old.update(zip(ids, per_sample))
        if data.tis_cap is None or data.rollout_logprobs is None:
            return old, None
        rollout = [data.rollout_logprobs[i] for i in ids]
        if all(r is not None for r in rollout):  # the usual case: one kernel for the micro-batch
            return old, torch.exp(old - torch.cat(rollout)).clamp(max=data.tis_cap)  # type: ignore[arg-type]
        weights = [
            torch.ones_like(o)
            if data.rollout_logprobs[i] is None
            else torch.exp(o - data.rollout_logprobs[i]).clamp(max=data.tis_cap)
            for i, o in zip(ids, per_sample)
        ]
        return old, torch.cat(weights)

    def _apply_update(self, skip: bool) -> dict[str, float]:
        if self.sharded is not None:
            return sharded_update(self, skip)
        if self.zero is not None:
            metrics = self.zero.apply_update(skip, self.lr)
            self.optimizer_steps_done += 1
            return metrics
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        if self.tp.enabled:
            self.model.reduce_tensor_parallel_gradients(self._named_grads())
        named = [(self._names[id(p)], p) for p in params]
        for dp, group_params in gradient_sets(self.model, named, self.dp, self.world):
            if dp.enabled:
                self._sum_gradients(group_params, dp)
        clip = self.cfg.optim.grad_clip
        if self.model_parallel:
            grad_norm = clip_split_gradients(
                self.model, self._named_grads(), clip if clip > 0 else float("inf"), self.device
            )
        else:
            grad_norm = torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else float("inf")).item()
        lr = self.lr
        set_lr(self.optimizer, lr)
        skip = skip or not math.isfinite(grad_norm)
        if skip:
            logger.warning("skipping an optimizer step (grad norm %s, or no loss tokens)", grad_norm)
            self.optimizer.zero_grad(set_to_none=True)
        else:
            self.optimizer.step()
            if self.masters is not None:
                self.masters.copy_to_model()
            # Freed now rather than at the next step's start: the engine generates in that memory meanwhile.
            self.optimizer.zero_grad(set_to_none=True)
        self.optimizer_steps_done += 1  # the schedule advances either way, so it stays aligned with RL steps
        return {"train/grad_norm": grad_norm, "train/lr": lr, "train/skipped_steps": float(skip)}

    def _tensor_parallel_union(self, samples: list[Sample]) -> list[Sample]:
        """Every TP rank's samples (the same list on each, ordered by (group, index) as one process's rollout
        returns them): the ranks of one replica train on one batch. Unchanged without tensor parallelism."""
        if not self.tp.enabled:
            return samples
        union = [s for part in self.tp.all_gather_objects(samples) for s in part]
        return sorted(union, key=lambda s: (s.group_id, s.index))

    def _positions(self, samples: list[Sample]) -> tuple[list[int], int]:
        """Where each of this rank's samples sits in the whole batch, and the batch's size. One process's
        batch is its list; across ranks the batch is ordered by (group, index), as one process's rollout
        returns it, so the optimizer steps hold the samples one process's would."""
        if not self.dp.enabled:
            return list(range(len(samples))), len(samples)
        keys = self.dp.all_gather_objects([(s.group_id, s.index) for s in samples])
        ordered = sorted((key, rank, i) for rank, part in enumerate(keys) for i, key in enumerate(part))
        positions = [0] * len(samples)
        for position, (_, rank, i) in enumerate(ordered):
            if rank == self.dp.rank:
                positions[i] = position
        return positions, len(ordered)

    def _sum_over_ranks(self, values: dict[str, float]) -> dict[str, float]:
        """Each rank's shares of the batch's metrics, summed (a rank without micro-batches has none)."""
        if not self.dp.enabled:
            return values
        totals: dict[str, float] = {}
        for part in self.dp.all_gather_objects(values):
            for name, value in part.items():
                totals[name] = totals.get(name, 0.0) + value
        return totals

    def _sum_gradients(self, params: list[torch.nn.Parameter], dp: DataParallel | None = None) -> None:
        """Sum the gradients across ranks (`dp`, default the replicas), in buckets. A parameter no rank
        produced a gradient for keeps none (AdamW skips it, as in one process); one that only some ranks did
        counts zeros elsewhere."""
        dp = self.dp if dp is None else dp
        anywhere = dp.all_reduce_floats([float(p.grad is not None) for p in params], "max")
        grads = []
        for p, has_grad in zip(params, anywhere):
            if has_grad:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                grads.append(p.grad)
        for bucket in _grad_buckets(grads):
            flat = dp.all_reduce(torch.cat([g.reshape(-1) for g in bucket]))
            offset = 0
            for g in bucket:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()

    def _throughput(
        self, samples: list[Sample], epochs: int, passes: int, seconds: float
    ) -> dict[str, float]:
        fed = [fed_length(s) for s in samples]
        response = sum(len(s.response_ids) for s in samples)
        flops = forward_flops(self.model.args, fed, response) * passes if self.peak_flops is not None else 0.0
        fed_total, response, flops = self.dp.all_reduce_floats([sum(fed), response, flops])
        seconds = max(self.dp.all_reduce_floats([seconds], "max")[0], 1e-9)
        metrics = {
            "train/tokens": float(fed_total * epochs),
            "train/response_tokens": float(response),
            "train/tokens_per_s": fed_total * epochs / seconds,
        }
        if self.peak_flops is not None:
            # every replica's FLOPs, on its TP group's devices
            devices = self.dp.world_size * self.tp.world_size
            metrics["train/mfu"] = flops / seconds / (self.peak_flops * devices)
        return metrics


_GRAD_BUCKET_ELEMENTS = 64 * 1024 * 1024
"""Gradient elements summed across ranks in one all-reduce."""


def _grad_buckets(grads: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Consecutive gradients of one dtype, up to `_GRAD_BUCKET_ELEMENTS` elements a bucket."""
    buckets: list[list[torch.Tensor]] = []
    size = 0
    for grad in grads:
        if not buckets or grad.dtype != buckets[-1][0].dtype or size + grad.numel() > _GRAD_BUCKET_ELEMENTS:
            buckets.append([])
            size = 0
        buckets[-1].append(grad)
        size += grad.numel()
    return buckets


def _summarise(step_metrics: list[dict[str, float]]) -> dict[str, float]:
    """Mean over optimizer steps; `train/lr` is the last step's, skipped steps are counted."""
    if not step_metrics:
        return {}
    summary = {k: sum(m.get(k, 0.0) for m in step_metrics) / len(step_metrics) for k in step_metrics[0]}
    summary["train/lr"] = step_metrics[-1]["train/lr"]
    summary["train/skipped_steps"] = sum(m["train/skipped_steps"] for m in step_metrics)
    summary["train/optimizer_steps"] = float(len(step_metrics))
    return summary
