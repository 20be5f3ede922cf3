"""Online training of the speculative-decoding draft model on the policy's rollouts (`rollout.spec_draft_train`).

A draft model proposes well only while its next-token distribution stays close to the policy's, and RL moves
the policy away from any fixed draft. Each RL step therefore also takes `spec_draft_train_epochs` optimizer
steps of the draft on that step's samples: the masked NLL of the sampled response tokens under the draft at
the rollout's temperature. The tokens were drawn from the policy's logits / T, and the engine draws each draft
token from the draft's logits / T (rollout/draft_draws.py), so this is a Monte-Carlo estimate of the forward
KL(policy_T || draft_T) up to the policy's entropy, the same distillation Miles and EAGLE-style online training
use; no extra policy forward is needed. (At temperature 1 instead, the draft would fit softmax(z_draft) to
softmax(z_policy / T) and then propose from that sharpened or flattened again by T.) A greedy rollout trains at
temperature 1: its argmax does not depend on T. The draft trains in place, in the module the engine drafts
with (the engine then drops the draft's cached keys and values: `Engine.draft_weights_changed`).

The verify step keeps plain decoding's samples whatever the draft proposes, so training it changes only
how many drafts are accepted, never what the policy learns from.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from miles.config import AlgorithmConfig, RolloutConfig, TrainerConfig
from miles.distributed import SINGLE, DataParallel
from miles.models.checkpoint import iter_hf_tensors, load_state_into, save_pretrained
from miles.models.model import CausalLM
from miles.resume import DRAFT_DIR
from miles.sample import Sample, SampleStatus
from miles.trainer.packing import response_loss_mask
from miles.trainer.policy_trainer import PolicyTrainer


def draft_trainer_config(trainer: TrainerConfig, rollout: RolloutConfig) -> TrainerConfig:
    """The policy trainer's settings with the draft's learning rate, a constant schedule and plain torch
    training of our own model (the draft is never a megatron module, tensor-parallel or routing-replayed)."""
    return replace(
        trainer,
        backend="torch",
        lr=rollout.spec_draft_lr,
        optim=replace(trainer.optim, schedule="constant", warmup_steps=0),
        tensor_parallel_size=1,
        routing_replay=False,
        epochs_per_rollout=1,
    )


def draft_temperature(rollout: RolloutConfig) -> float:
    """The temperature the draft is trained at: the rollout's, which the engine draws its drafts with (1 for
    greedy rollouts, whose argmax any temperature keeps)."""
    return rollout.temperature if rollout.temperature > 0 else 1.0


def check_draft_settings(rollout: RolloutConfig) -> None:
    """Raise ValueError for draft-training settings no run can use."""
    if rollout.spec_draft_train_epochs < 1:
        raise ValueError(
            f"rollout.spec_draft_train_epochs must be >= 1, got {rollout.spec_draft_train_epochs}"
        )
    if not 0 < rollout.spec_draft_lr < math.inf:
        raise ValueError(f"rollout.spec_draft_lr must be positive and finite, got {rollout.spec_draft_lr}")


class DraftTrainer:
    weights_dir = DRAFT_DIR
    """A checkpoint's subfolder holding the trained draft."""

    def __init__(
        self,
        draft: CausalLM,
        policy_vocab_size: int,
        trainer: TrainerConfig,
        rollout: RolloutConfig,
        algorithm: AlgorithmConfig,
        dp: DataParallel = SINGLE,
    ) -> None:
        check_draft_settings(rollout)
        if draft.args.vocab_size > policy_vocab_size:
            raise ValueError(
                f"the draft model's vocabulary ({draft.args.vocab_size} tokens) is larger than the policy's "
                f"({policy_vocab_size}): a draft model must share the policy's tokenizer"
            )
        self.policy_vocab_size = policy_vocab_size
        self.model = draft
        self.epochs = rollout.spec_draft_train_epochs
        self.max_tokens = draft.args.context_length
        draft.requires_grad_(True)  # a draft loaded for the engine alone may come frozen
        # The sft loss reads only the loss aggregation and the entropy coefficient of the algorithm.
        self.trainer = PolicyTrainer(
            draft,
            draft_trainer_config(trainer, rollout),
            replace(algorithm, kl_coef=0.0),
            temperature=draft_temperature(rollout),
            total_optimizer_steps=trainer.max_steps * self.epochs,
            dp=dp,
        )
        self.dp = dp

    def memory_reserve_bytes(self) -> int:
        return self.trainer.memory_reserve_bytes()

    def training_samples(self, samples: list[Sample]) -> tuple[list[Sample], int]:
        """The samples the draft learns from, as copies that carry the tokens, the loss mask (tool outputs of
        multi-turn samples stay masked) and the batch order: those with a response, cut to the draft's
        context where longer (the part that fits still teaches it); ids past the draft's vocabulary (a
        smaller, padded one) are fed as its last id and not trained on. Returns them and how many were cut."""
        vocab = self.model.args.vocab_size
        kept, cut = [], 0
        for s in samples:
            # Response tokens that fit (a sample feeds its prompt and all of its response but the last).
            room = self.max_tokens - len(s.prompt_ids) + 1
            if not s.response_ids or not s.prompt_ids or s.status == SampleStatus.ABORTED or room < 1:
                continue
            response, mask = s.response_ids[:room], response_loss_mask(s)[:room]
            cut += len(response) < len(s.response_ids)
            prompt = s.prompt_ids
            if self.policy_vocab_size > vocab:
                mask = [m if t < vocab else 0 for m, t in zip(mask, response)]
                prompt = [min(t, vocab - 1) for t in prompt]
                response = [min(t, vocab - 1) for t in response]
            kept.append(
                Sample(
                    prompt=s.prompt,
                    prompt_ids=prompt,
                    response_ids=response,
                    loss_mask=mask,
                    group_id=s.group_id,
                    index=s.index,
                )
            )
        return kept, cut

    def train_step(self, samples: list[Sample]) -> dict[str, float]:
        """`spec_draft_train_epochs` optimizer steps on the step's samples (every rank calls it, with its
        own). `draft/loss` is the first epoch's: the draft's NLL of tokens it has not been trained on yet."""
        usable, cut = self.training_samples(samples)
        total, skipped, truncated = self.dp.all_reduce_floats(
            [float(len(usable)), float(len(samples) - len(usable)), float(cut)]
        )
        metrics: dict[str, float] = {"draft/skipped_samples": skipped, "draft/truncated_samples": truncated}
        if total == 0:
            return metrics
        epochs = [self.trainer.sft_step(usable, self.trainer.temperature) for _ in range(self.epochs)]
        metrics.update(
            {
                "draft/loss": epochs[0]["train/loss"],
                "draft/loss_last_epoch": epochs[-1]["train/loss"],
                "draft/grad_norm": sum(m["train/grad_norm"] for m in epochs) / len(epochs),
                "draft/skipped_steps": sum(m["train/skipped_steps"] for m in epochs),
                "draft/lr": epochs[-1]["train/lr"],
                "draft/tokens_per_s": sum(m["train/tokens_per_s"] for m in epochs) / len(epochs),
            }
        )
        return metrics

    def save_weights(self, checkpoint: Path) -> None:
        save_pretrained(self.model, checkpoint / self.weights_dir)

    def load_weights(self, checkpoint: Path) -> None:
        with torch.no_grad():
            load_state_into(self.model, iter_hf_tensors(checkpoint / self.weights_dir))

    def state_dict(self) -> dict[str, Any]:
        return self.trainer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.trainer.load_state_dict(state)
