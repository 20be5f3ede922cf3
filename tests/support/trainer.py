"""Tiny dense models, random scored samples and a trainer on them: what the trainer tests share."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from miles.config import AlgorithmConfig, OptimConfig, TrainerConfig
from miles.models import CausalLM, ModelArgs
from miles.sample import Sample
from miles.trainer import PolicyTrainer

VOCAB = 32


def tiny_model(seed: int = 0, std: float = 0.2, **overrides: int) -> CausalLM:
    shape = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
    )
    model = CausalLM(ModelArgs(model_type="qwen3_moe", **{**shape, **overrides}))
    model.init_weights(std=std, generator=torch.Generator().manual_seed(seed))
    return model


def random_samples(n: int, seed: int = 0) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(n):
        prompt_len = int(torch.randint(2, 7, (1,), generator=g))
        response_len = int(torch.randint(1, 7, (1,), generator=g))
        samples.append(
            Sample(
                prompt_ids=torch.randint(0, VOCAB, (prompt_len,), generator=g).tolist(),
                response_ids=torch.randint(0, VOCAB, (response_len,), generator=g).tolist(),
                group_id=i // 2,
                index=i % 2,
            )
        )
    return samples


def reference_logprobs(
    model: CausalLM, sample: Sample, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprobs and entropy of the response tokens from one unpacked full forward `model(input_ids[1, T])`."""
    ids = torch.tensor([sample.prompt_ids + sample.response_ids])
    logits = model(ids)[0].float() / temperature
    p = len(sample.prompt_ids)
    log_probs = F.log_softmax(logits[p - 1 : p - 1 + len(sample.response_ids)], dim=-1)
    token = log_probs.gather(-1, torch.tensor(sample.response_ids)[:, None]).squeeze(-1)
    return token, -(log_probs.exp() * log_probs).sum(-1)


def keep_gradients(trainer: PolicyTrainer) -> list[dict[str, torch.Tensor]]:
    """The gradients each optimizer step of `trainer` takes (the trainer frees them right after), by name."""
    kept: list[dict[str, torch.Tensor]] = []
    step = trainer.optimizer.step

    def step_and_keep(*args, **kwargs):
        tensors = [t for group in trainer.optimizer.param_groups for t in group["params"]]
        kept.append({trainer._names[id(t)]: t.grad.clone() for t in tensors if t.grad is not None})
        return step(*args, **kwargs)

    trainer.optimizer.step = step_and_keep
    return kept


def make_trainer(
    model: CausalLM,
    ref: CausalLM | None = None,
    algorithm: AlgorithmConfig | None = None,
    temperature: float = 1.0,
    **cfg_kwargs,
) -> PolicyTrainer:
    optim = cfg_kwargs.pop("optim", OptimConfig(grad_clip=0.0))
    cfg = TrainerConfig(optim=optim, **cfg_kwargs)
    return PolicyTrainer(model, cfg, algorithm or AlgorithmConfig(tis=False), temperature, ref_model=ref)
