"""Online training of the draft head (`rollout.speculative=head`, `rollout.spec_draft_train`).

Each RL step, before the policy's update, the policy that drew the step's samples runs one forward over them
(no gradients) for its final-norm hidden states H; its LM head over H[t] is its distribution of token t + 1.
The head is then unrolled exactly as the engine runs it (rollout/draft_head.py): step 1 takes H[t] and the
embedding of token t + 1, step i its own output of step i - 1 and the embedding of token t + i, each giving
logits for token t + i + 1. The loss is KL(policy || head) between the policy's distribution at t + i,
computed from H[t + i], and the head's, at the rollout's temperature, over every response position t and
step i = 1 .. spec_draft_tokens whose target is a trained response token (tool outputs stay masked).
Feeding the true tokens is what the engine does on the path that matters: a draft is only kept while the
tokens before it were right, and the head's own states are fed back during training as during proposing,
so nothing differs between the two but the tokens after the first wrong draft.

The head's weights are the engine's (trained in place, float32 master copies for a 16-bit head); the
model's embedding and LM head are used, never trained. Data-parallel ranks sum their gradients.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from miles.config import RolloutConfig, TrainerConfig
from miles.distributed import SINGLE, DataParallel
from miles.models.attention import VarlenAttention
from miles.models.draft_head import DraftHead, load_draft_head, save_draft_head
from miles.models.model import CausalLM
from miles.resume import DRAFT_HEAD_DIR
from miles.sample import Sample, SampleStatus
from miles.trainer.draft.model_trainer import check_draft_settings, draft_temperature, draft_trainer_config
from miles.trainer.master_weights import MasterWeights, wants_master_weights
from miles.trainer.optim import build_optimizer, set_lr
from miles.trainer.packing import response_loss_mask

logger = logging.getLogger(__name__)

_LOSS_ROWS = 1024
"""Rows of [rows, vocab] logits computed at once in the loss (recomputed in the backward pass)."""


class DraftHeadTrainer:
    weights_dir = DRAFT_HEAD_DIR
    """A checkpoint's subfolder holding the trained head (usable as rollout.spec_head)."""

    def __init__(
        self,
        head: DraftHead,
        policy: CausalLM,
        trainer: TrainerConfig,
        rollout: RolloutConfig,
        dp: DataParallel = SINGLE,
    ) -> None:
        """`policy`: the model the head drafts for, whose hidden states it learns from (the engine's)."""
        check_draft_settings(rollout)
        head.args.check_fits(policy.args)
        self.head, self.policy, self.dp = head, policy, dp
        self.depth = rollout.spec_draft_tokens
        self.epochs = rollout.spec_draft_train_epochs
        self.temperature = draft_temperature(rollout)
        self.max_tokens = max(trainer.micro_batch_tokens, 1)
        self.max_context = policy.args.context_length
        cfg = draft_trainer_config(trainer, rollout)
        self.grad_clip = cfg.optim.grad_clip
        self.lr = cfg.lr
        """Constant (draft_trainer_config): re-applied each step, so a resume's rollout.spec_draft_lr holds."""
        head.requires_grad_(True)
        self.masters = MasterWeights(head) if wants_master_weights(head, True) else None
        self.params = self.masters.masters if self.masters is not None else list(head.parameters())
        self.optimizer = build_optimizer(self.params, cfg)
        self.names = [n for n, _ in head.named_parameters()]

    def memory_reserve_bytes(self) -> int:
        """Gradients and AdamW's two moments (and the float32 masters of a 16-bit head)."""
        floats = sum(p.numel() for p in self.head.parameters())
        return floats * 4 * (4 if self.masters is not None else 3)

    # data ----------------------------------------------------------------------------------------
    def _usable(self, samples: list[Sample]) -> tuple[list[tuple[list[int], list[int], list[int]]], int]:
        """(prompt ids, response ids, loss mask) of the samples that can teach the head (a response of two
        tokens or more, inside the policy's context), and how many were left out."""
        kept = []
        for s in samples:
            length = len(s.prompt_ids) + len(s.response_ids) - 1
            if s.status == SampleStatus.ABORTED or len(s.response_ids) < 2 or not s.prompt_ids:
                continue
            if length > self.max_context:
                continue
            kept.append((list(s.prompt_ids), list(s.response_ids), response_loss_mask(s)))
        return kept, len(samples) - len(kept)

    def _micro_batches(self, rows: list[tuple[list[int], list[int], list[int]]]) -> list[list[int]]:
        batches: list[list[int]] = [[]]
        used = 0
        for i, (prompt, response, _) in enumerate(rows):
            length = len(prompt) + len(response) - 1
            if batches[-1] and used + length > self.max_tokens:
                batches.append([])
                used = 0
            batches[-1].append(i)
            used += length
        return batches

    def _targets(self, response: list[int], mask: list[int]) -> list[int]:
        """Per step i = 1 .. depth, the response positions j whose step-i target (token j + i) is trained."""
        return [sum(1 for j in range(len(response) - i) if mask[j + i]) for i in range(1, self.depth + 1)]

    # training ------------------------------------------------------------------------------------
    @torch.no_grad()
    def _features(self, rows: list[tuple[list[int], list[int], list[int]]]) -> torch.Tensor:
        """[sum of response lengths, hidden]: per sample, the policy's hidden states at positions
        len(prompt) - 1 .. the last but one (row j gives the policy's distribution of response token j)."""
        device = self.policy.device
        seqs = [prompt + response[:-1] for prompt, response, _ in rows]
        lens = [len(s) for s in seqs]
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        ids = torch.tensor([t for s in seqs for t in s], dtype=torch.long, device=device)
        positions = torch.cat([torch.arange(n, device=device) for n in lens])
        was_training = self.policy.training
        self.policy.eval()
        try:
            hidden = self.policy.forward_packed(ids, positions, VarlenAttention(cu)).hidden
        finally:
            self.policy.train(was_training)
        picks = torch.cat(
            [torch.arange(cu[k] + len(p) - 1, cu[k + 1], device=device) for k, (p, _, _) in enumerate(rows)]
        )
        return hidden[picks].to(self.head.dtype)

    def _loss_sum(
        self, rows: list[tuple[list[int], list[int], list[int]]], features: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(sum of KL over the micro-batch's (position, step) targets, how many of them the head's most
        likely token agrees with the policy's, the number of targets); `features`: `_features(rows)`."""
        device = self.head.device
        responses = torch.tensor([t for _, r, _ in rows for t in r], dtype=torch.long, device=device)
        masks = torch.tensor([m for _, _, mask in rows for m in mask], dtype=torch.bool, device=device)
        lengths = torch.tensor([len(r) for _, r, _ in rows], device=device)
        starts = torch.cumsum(lengths, 0) - lengths
        within = torch.arange(len(responses), device=device) - torch.repeat_interleave(starts, lengths)
        left = torch.repeat_interleave(lengths, lengths) - within  # response tokens from j on
        last = len(responses) - 1
        # The policy's weights are read, never trained: detached, so that no gradient reaches the policy's
        # own (which its update would then add in) and none is computed.
        embed_weight = self.policy.model.embed_tokens.weight.detach()
        lm_weight = self.policy.lm_head.weight.detach()
        state = features
        total = torch.zeros((), device=device, dtype=torch.float32)
        agreed = torch.zeros((), device=device, dtype=torch.float32)
        count = 0
        flat = torch.arange(len(responses), device=device)
        for i in range(1, self.depth + 1):
            fed = responses[(flat + i - 1).clamp(max=last)]
            state = self.head(state, F.embedding(fed, embed_weight))
            target = (flat + i).clamp(max=last)
            valid = (left > i) & masks[target]
            picked = valid.nonzero().squeeze(1)
            if not len(picked):  # (a later step may still have targets: tool outputs are masked)
                continue
            count += len(picked)
            for s in range(0, len(picked), _LOSS_ROWS):
                chunk = picked[s : s + _LOSS_ROWS]
                kl, same = checkpoint(
                    _kl_rows,
                    state[chunk],
                    features[target[chunk]],
                    lm_weight,
                    self.temperature,
                    use_reentrant=False,
                )
                total = total + kl
                agreed = agreed + same
        return total, agreed, count

    def train_step(self, samples: list[Sample]) -> dict[str, float]:
        """`spec_draft_train_epochs` optimizer steps on the step's samples (every rank calls it, with its
        own). `draft/loss` is the first epoch's mean KL per target: how far behind the policy the head is."""
        rows, skipped = self._usable(samples)
        local_targets = float(sum(sum(self._targets(r, m)) for _, r, m in rows))
        targets, total_skipped = self.dp.all_reduce_floats([local_targets, float(skipped)])
        metrics: dict[str, float] = {"draft/skipped_samples": total_skipped}
        if targets == 0:
            return metrics
        began = time.perf_counter()
        batches = [[rows[i] for i in batch] for batch in self._micro_batches(rows)] if rows else []
        # The policy does not change between epochs: with several, its hidden states are computed once
        # and kept (sum of response lengths x hidden size), with one they are made per micro-batch.
        kept = [self._features(batch) for batch in batches] if self.epochs > 1 else None
        policy_s = time.perf_counter() - began
        epochs = []
        self.head.train()
        for _ in range(self.epochs):
            began = time.perf_counter()
            loss = agreed = 0.0
            for k, batch in enumerate(batches):
                features = kept[k] if kept is not None else self._features(batch)
                part, same, _ = self._loss_sum(batch, features)
                (part / targets).backward()
                loss += float(part.detach())
                agreed += float(same)
            norm, skipped_step = self._step()
            loss, agreed = self.dp.all_reduce_floats([loss, agreed])
            epochs.append((loss / targets, agreed / targets, norm, skipped_step, time.perf_counter() - began))
        self.head.eval()
        tokens = sum(len(p) + len(r) - 1 for p, r, _ in rows)
        metrics.update(
            {
                "draft/loss": epochs[0][0],
                "draft/loss_last_epoch": epochs[-1][0],
                "draft/top1_agreement": epochs[0][1],
                "draft/grad_norm": sum(e[2] for e in epochs) / len(epochs),
                "draft/skipped_steps": float(sum(e[3] for e in epochs)),
                "draft/lr": self.optimizer.param_groups[0]["lr"],
                "draft/tokens_per_s": tokens * len(epochs) / max(policy_s + sum(e[4] for e in epochs), 1e-9),
            }
        )
        return metrics

    def _step(self) -> tuple[float, bool]:
        """Sum the ranks' gradients, clip, step; returns the global gradient norm before clipping and
        whether the step was skipped (a non-finite norm, as PolicyTrainer skips it: AdamW would write the
        NaN into the weights and moments for good)."""
        for param in self.params:  # a rank without samples still takes part in the sums
            if param.grad is None:
                param.grad = torch.zeros_like(param)
        grads = [param.grad for param in self.params]
        for g in grads:
            self.dp.all_reduce(g)
        # As PolicyTrainer clips: torch's own clip over the summed gradients (0 disables clipping).
        clip = self.grad_clip if self.grad_clip > 0 else float("inf")
        norm = float(torch.nn.utils.clip_grad_norm_(self.params, clip))
        # The norm is of the summed gradients, so every rank takes the same decision.
        skip = not math.isfinite(norm)
        set_lr(self.optimizer, self.lr)
        if skip:
            logger.warning("skipping a draft head optimizer step (grad norm %s)", norm)
        else:
            self.optimizer.step()
            if self.masters is not None:
                self.masters.copy_to_model()
        self.optimizer.zero_grad(set_to_none=True)
        return norm, skip

    # state ---------------------------------------------------------------------------------------
    def save_weights(self, checkpoint: Path) -> None:
        save_draft_head(self.head, checkpoint / self.weights_dir)

    def load_weights(self, checkpoint: Path) -> None:
        saved = load_draft_head(checkpoint / self.weights_dir, self.head.dtype, self.head.device)
        if saved.args != self.head.args:
            raise ValueError(
                f"{checkpoint / self.weights_dir} holds a head of another shape ({saved.args}) than this run's "
                f"({self.head.args}); resume with the run's own rollout.spec_head_intermediate_size"
            )
        with torch.no_grad():
            for mine, theirs in zip(self.head.parameters(), saved.parameters()):
                mine.copy_(theirs)
        if self.masters is not None:
            self.masters.copy_from_model()

    def state_dict(self) -> dict[str, Any]:
        """{"tensors", "meta"} as resume.py stores a trainer's: AdamW's moments and steps by parameter name,
        and the float32 masters of a 16-bit head."""
        saved = self.optimizer.state_dict()
        tensors: dict[str, torch.Tensor] = {}
        index = self._index_names()
        for idx, state in saved["state"].items():
            for key, value in state.items():
                tensors[f"optimizer.{index[idx]}.{key}"] = value.detach().to("cpu").contiguous()
        if self.masters is not None:
            for name, master in self.masters.named_masters():
                tensors[f"master.{name}"] = master.detach().to("cpu").contiguous()
        groups = [{k: v for k, v in g.items() if k != "params"} for g in saved["param_groups"]]
        return {"tensors": tensors, "meta": {"kind": "draft_head", "param_groups": groups}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        meta, tensors = state["meta"], state["tensors"]
        if meta.get("kind") != "draft_head":
            raise ValueError(
                "the checkpoint's draft optimizer state is not a draft head's (it trained a draft model: "
                "rollout.speculative=draft); resume with the run's own rollout.speculative"
            )
        if self.masters is not None:
            with torch.no_grad():
                for name, master in self.masters.named_masters():
                    master.copy_(tensors[f"master.{name}"])
            self.masters.copy_to_model()
        saved = self.optimizer.state_dict()
        for idx, name in self._index_names().items():
            prefix = f"optimizer.{name}."
            entry = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
            if entry:  # load_state_dict moves them to the parameter's device
                saved["state"][idx] = entry
        # Only the per-parameter state is the checkpoint's: lr, betas, eps and weight_decay stay this run's
        # (as DraftTrainer's PolicyTrainer does), so settings changed for the resume take effect.
        self.optimizer.load_state_dict(saved)

    def _index_names(self) -> dict[int, str]:
        """The optimizer's parameter indices -> the head's parameter names."""
        by_id = {id(p): n for n, p in zip(self.names, self.params)}
        ordered = [p for g in self.optimizer.param_groups for p in g["params"]]
        return {i: by_id[id(p)] for i, p in enumerate(ordered)}


def _kl_rows(
    state: torch.Tensor, target: torch.Tensor, lm_weight: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed KL(policy || head) over rows, from the head's states and the policy's hidden states (both
    through the LM head at `temperature`), and how many rows' most likely tokens agree."""
    head = (F.linear(state, lm_weight).float() / temperature).log_softmax(-1)
    with torch.no_grad():
        policy = (F.linear(target, lm_weight).float() / temperature).log_softmax(-1)
        same = (head.argmax(-1) == policy.argmax(-1)).sum().float()
    return (policy.exp() * (policy - head)).sum(), same
