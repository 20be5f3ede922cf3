"""The HF baseline of `miles bench rollout --hf-baseline`: `transformers`' `generate` on the engine's own
weights (shared, not copied), same prompts and lengths."""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from miles.models import CausalLM


def hf_sharing(model: CausalLM) -> Any:
    """A transformers model whose parameters are this model's tensors (no copy)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from miles.models.checkpoint import internal_to_hf

    config = AutoConfig.for_model(**model.args.to_hf_dict())
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(config, dtype=model.dtype)
    state = model.state_dict()
    missing, unexpected = hf.load_state_dict(state, strict=False, assign=True)
    if unexpected or [k for k in missing if k != "lm_head.weight"]:
        hf.load_state_dict(dict(internal_to_hf(state, model.args)), strict=False, assign=True)
    if model.args.tie_word_embeddings:
        hf.lm_head.weight = hf.model.embed_tokens.weight
    hf.model.rotary_emb = type(hf.model.rotary_emb)(config=hf.config).to(model.device)
    leftover = [n for n, t in [*hf.named_parameters(), *hf.named_buffers()] if t.is_meta]
    if leftover:
        raise RuntimeError(f"could not map weights into the transformers model: {leftover[:5]}")
    return hf.eval()


class HFBaseline:
    """`transformers`' `generate` on the engine's model (shared weights), same prompts and lengths: built and
    warmed up once, then timed run by run."""

    def __init__(
        self, model: CausalLM, prompts: list[list[int]], a: argparse.Namespace, device: torch.device
    ) -> None:
        self.hf, self.device = hf_sharing(model), device
        self.num = min(a.hf_num_prompts or len(prompts), len(prompts))
        self.out_len = a.hf_output_len or a.output_len
        self.ids = torch.tensor(prompts[: self.num], device=device)
        with torch.no_grad():  # same weights: the two models agree on a short input
            probe = self.ids[:1, :16]
            ours = model(probe).float()
            self.rel_err = float((self.hf(probe).logits.float() - ours).norm() / ours.norm())
        self.kwargs: dict[str, Any] = dict(
            attention_mask=torch.ones_like(self.ids),
            max_new_tokens=self.out_len,
            min_new_tokens=self.out_len,
            num_return_sequences=a.n,
            pad_token_id=0,
        )
        if a.temperature > 0:
            top_k = a.top_k if a.top_k > 0 else 0
            self.kwargs.update(do_sample=True, temperature=a.temperature, top_k=top_k, top_p=a.top_p)
            if a.min_p > 0:
                self.kwargs["min_p"] = a.min_p
        else:
            self.kwargs.update(do_sample=False)
        warm = self.ids[: min(2, self.num), :32]
        warm_kwargs = {**self.kwargs, "attention_mask": torch.ones_like(warm)}
        with torch.no_grad():
            self.hf.generate(warm, **{**warm_kwargs, "max_new_tokens": 2, "min_new_tokens": 2})
        self.walls: list[float] = []
        self.generated = 0

    def run(self) -> None:
        on_gpu = self.device.type == "cuda"
        with torch.no_grad():
            if on_gpu:
                torch.cuda.synchronize(self.device)
            t0 = time.perf_counter()
            out = self.hf.generate(self.ids, **self.kwargs)
            if on_gpu:
                torch.cuda.synchronize(self.device)
            self.walls.append(time.perf_counter() - t0)
        self.generated = (out.shape[1] - self.ids.shape[1]) * out.shape[0]

    def result(self) -> dict[str, Any]:
        wall = statistics.median(self.walls)
        return {
            "hf_num_prompts": self.num,
            "hf_output_len": self.out_len,
            "hf_wall_s": wall,
            "hf_wall_s_runs": self.walls,
            "hf_output_tokens_per_s": self.generated / wall,
            "hf_logits_rel_err": self.rel_err,
        }
