"""`SamplingParams`: what one `generate` call asks of the engine (per prompt; `n` samples each)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from miles.config import RolloutConfig


MIN_TEMPERATURE = 1e-30
"""The smallest positive temperature accepted (0 is greedy). Below it the sampler's float32 logits / T can
overflow (at 1e-38, a logit of 3.4 does): inf - inf is NaN, and the row drew a wrong token with a NaN logprob.
Above it any logit under 3e8 in magnitude stays finite, and a temperature of 1e-9 samples the argmax."""


@dataclass
class SamplingParams:
    n: int = 1
    """Samples per prompt (the GRPO group size); they share the prompt's KV through the radix cache."""
    temperature: float = 1.0
    """0 is greedy (see sampler.py for the logprob convention)."""
    top_p: float = 1.0
    top_k: int = -1
    """-1 (or 0) disables."""
    min_p: float = 0.0
    max_new_tokens: int = 128
    stop_token_ids: list[int] = field(default_factory=list)
    """Extra token ids that end a response (the EOS ids of the model/tokenizer always do, unless ignore_eos)."""
    stop: list[str] = field(default_factory=list)
    """Stop strings (need a tokenizer); the response text is cut before the stop string."""
    seed: int | None = None
    """Same seed -> same output whatever else is in the batch; None draws from the engine's seed sequence."""
    ignore_eos: bool = False
    """Keep generating past the EOS ids (benchmarks); `stop_token_ids` and `stop` still apply."""
    return_routing: bool = False
    """Fill `Sample.routed_experts` (MoE models)."""
    top_logprobs: int = 0
    """Fill `Sample.top_logprobs` with this many alternatives per response token (at most 20): the most
    likely tokens and their logprobs under the distribution the token was sampled from. Such requests get
    no speculative drafts."""

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if not 0 <= self.temperature < math.inf:  # NaN fails too
            raise ValueError(f"temperature must be >= 0 and finite (0 = greedy), got {self.temperature}")
        if 0 < self.temperature < MIN_TEMPERATURE:
            raise ValueError(
                f"temperature {self.temperature} is below {MIN_TEMPERATURE:g}, where the sampler's float32 "
                "logits / temperature can overflow; use 0 for greedy decoding"
            )
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        if self.top_k == 0:
            self.top_k = -1
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not 0 <= self.top_logprobs <= 20:  # sampling.MAX_TOP_LOGPROBS (not imported: torch-free module)
            raise ValueError(f"top_logprobs must be in [0, 20], got {self.top_logprobs}")
        self.stop_token_ids = [int(t) for t in self.stop_token_ids]
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_filter(self) -> bool:
        """True when top-k / top-p / min-p change the distribution (the sorted sampling path)."""
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0

    def with_(self, **changes: object) -> SamplingParams:
        return replace(self, **changes)

    @classmethod
    def from_config(
        cls,
        cfg: RolloutConfig,
        stop_token_ids: Sequence[int] = (),
        seed: int | None = None,
        **overrides: object,
    ) -> SamplingParams:
        """The RL loop's params: the rollout config's sampling settings (`rollout.record_routing` asks for the
        routing), with what the config does not hold: `stop_token_ids` (the end ids the loop collects from the
        model and tokenizer) and `seed` (None: the engine's own seed sequence). `overrides` replace any field."""
        values: dict[str, object] = dict(
            n=cfg.n_samples_per_prompt,
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            top_k=cfg.top_k,
            min_p=cfg.min_p,
            max_new_tokens=cfg.max_new_tokens,
            stop_token_ids=list(stop_token_ids),
            stop=list(cfg.stop),
            seed=seed,
            return_routing=cfg.record_routing,
        )
        values.update(overrides)
        return cls(**values)  # type: ignore[arg-type]
