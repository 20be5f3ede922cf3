"""What every command builds from a config, once: the model and tokenizer, the tokenised prompts, the stop
ids, the trainer over the chosen backend, the engine and the rewards. The RL loop, SFT and the CLI
commands all start here."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import torch

from miles.config import MilesConfig
from miles.data import PromptFormatter, load_rows, to_samples
from miles.distributed import SINGLE, DataParallel
from miles.model_io import load_model
from miles.sample import Sample
from miles.sft.examples import end_of_turn_id


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def set_cpu_threads(threads: int) -> None:
    # On 2 shared cores a second intra-op thread makes tiny-model kernels tens of times slower.
    if threads > 0:
        torch.set_num_threads(threads)


def stop_ids(tokenizer: object, model_eos: list[int], formatter: PromptFormatter | None = None) -> list[int]:
    """The model's and the tokenizer's eos ids, and with chat-formatted prompts (`formatter`) the token the
    template ends an assistant turn with (`<|im_end|>`), which a base model's config may not list (it has
    `<|endoftext|>`)."""
    ids = set(model_eos)
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is not None:
        ids.add(int(eos))
    end_of_turn = end_of_turn_id(formatter) if formatter is not None else None
    if end_of_turn is not None:
        ids.add(end_of_turn)
    return sorted(ids)


@dataclass
class RunInputs:
    """What every job starts from: the model and tokenizer, and the tokenised prompts."""

    model: Any  # CausalLM
    tokenizer: Any
    train_prompts: list[Sample]
    test_prompts: list[Sample]
    dropped_prompts: int
    stop_token_ids: list[int]
    dropped_eval_prompts: int = 0  # held-out prompts over data.max_prompt_length: the eval runs without them

    def dropped_metrics(self) -> dict[str, float]:
        return {
            "data/dropped_prompts": float(self.dropped_prompts),
            "data/dropped_eval_prompts": float(self.dropped_eval_prompts),
        }


def build_inputs(cfg: MilesConfig, dp: DataParallel = SINGLE) -> RunInputs:
    seed_everything(cfg.trainer.seed)
    set_cpu_threads(cfg.placement.cpu_threads)
    loaded = load_model(cfg.model.path, cfg.model.dtype, cfg.model.device, seed=cfg.trainer.seed)
    dp.broadcast_module(loaded.model)  # the replicas start from rank 0's weights, however they were made
    formatter = PromptFormatter(loaded.tokenizer, cfg.data, cfg.model.chat_template)
    train_rows, test_rows = load_rows(cfg.data)
    train_prompts, dropped = to_samples(train_rows, formatter, cfg.data.max_prompt_length)
    test_prompts, dropped_eval = to_samples(test_rows, formatter, cfg.data.max_prompt_length)
    eos = stop_ids(loaded.tokenizer, loaded.model.args.eos_token_ids, formatter)
    return RunInputs(loaded.model, loaded.tokenizer, train_prompts, test_prompts, dropped, eos, dropped_eval)


def build_reference(cfg: MilesConfig, dp: DataParallel = SINGLE) -> Any:
    """The frozen reference model a KL penalty compares against (None without one)."""
    if cfg.algorithm.kl_coef <= 0:
        return None
    ref_model = load_model(cfg.model.path, cfg.model.dtype, cfg.model.device, seed=cfg.trainer.seed).model
    ref_model.requires_grad_(False)
    dp.broadcast_module(ref_model)
    return ref_model


def build_trainer(
    cfg: MilesConfig,
    model: Any,
    dp: DataParallel = SINGLE,
    temperature: float | None = None,
    ref_model: Any = None,
    total_optimizer_steps: int | None = None,
    routing_replay: bool | None = None,
) -> Any:
    """A `PolicyTrainer` over the policy module of `trainer.backend`, starting from `model`'s weights."""
    from miles.trainer import PolicyTrainer
    from miles.trainer.backends import build_policy

    policy = build_policy(
        cfg.trainer.backend,
        model,
        cfg.trainer.routing_replay if routing_replay is None else routing_replay,
        cfg.trainer.precision,
        cfg.trainer.tensor_parallel_size,
        cfg.trainer.expert_parallel_size,
        cfg.trainer.expert_tensor_parallel_size,
    )
    return PolicyTrainer(
        policy,
        cfg.trainer,
        cfg.algorithm,
        temperature=cfg.rollout.temperature if temperature is None else temperature,
        ref_model=ref_model,
        total_optimizer_steps=total_optimizer_steps,
        dp=dp,
    )


def build_engine(cfg: MilesConfig, model: Any, tokenizer: Any, reserve_bytes: int = 0, **drafts: Any) -> Any:
    """The rollout engine over `model` (its own weights: the trainer's module on the embedded placement);
    `reserve_bytes` is what the trainer's first update needs beside the KV pool."""
    from miles.rollout import Engine

    return Engine(model, tokenizer, cfg.rollout, reserve_bytes=reserve_bytes, **drafts)


def build_rewards(cfg: MilesConfig, engine: Any = None) -> Any:
    """The reward runner of `cfg.reward`; `engine` serves a judge reward that generates."""
    from miles.rewards import RewardRunner

    return RewardRunner(cfg.reward, engine=engine)
