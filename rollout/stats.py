"""`EngineStats`: the engine's counters, and the rollout/* metrics they give over a window."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineStats:
    output_tokens: int = 0
    prompt_tokens: int = 0
    """Prompt tokens of first admissions (the hit-rate denominator)."""
    cached_prompt_tokens: int = 0
    """Of those, found in the radix cache."""
    prefill_tokens: int = 0
    """Tokens computed in prefill / extend chunks (recomputation after preemption included)."""
    decode_tokens: int = 0
    preemptions: int = 0
    requests: int = 0
    aborted: int = 0
    truncated: int = 0
    steps: int = 0
    decode_steps: int = 0
    prefill_s: float = 0.0
    """Wall time of steps that computed any prefill chunk."""
    decode_s: float = 0.0
    """Wall time of pure decode steps."""
    decode_step_tokens: int = 0
    """Tokens computed in pure decode steps (`decode_tokens` also counts the decode rows of mixed steps,
    whose time is in `prefill_s`): with `decode_s` and `decode_kv_tokens`, the decode rate and roofline."""
    decode_kv_tokens: int = 0
    """Sum over decode steps of the tokens attended (for the decode roofline)."""
    peak_used_tokens: int = 0
    dropped_rows: int = 0
    """Overlap scheduling: decode rows computed for requests their previous token had already finished."""
    spec_steps: int = 0
    """Speculative decoding: request-steps that verified a draft, draft tokens (filler included), those the
    n-grams proposed, and those accepted."""
    spec_draft_tokens: int = 0
    spec_proposed_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_draft_s: float = 0.0
    """Wall time spent proposing drafts (the draft model's forwards and draws, or the n-gram lookups; a
    draft head's proposals chained behind verify steps are in those steps' time)."""
    spec_gated_steps: int = 0
    """Steps that ran plain because the drafts kept too few tokens (`rollout.spec_min_accept_length`)."""
    spec_chained_drafts: int = 0
    """Request-steps whose draft head proposal was chained on the device behind the verify step before."""
    device_wait_s: float = 0.0
    """Overlap scheduling: host time spent waiting for a step's tokens. Near 0, the device waited for the
    host instead (host-bound); near the step time, the host kept ahead of the device."""

    def count_step(self, decode: bool, seconds: float, tokens: int, kv_tokens: int) -> None:
        """A step that launched a forward of `tokens` tokens attending `kv_tokens`, taking `seconds`."""
        self.steps += 1
        if decode:
            self.decode_steps += 1
            self.decode_s += seconds
            self.decode_step_tokens += tokens
            self.decode_kv_tokens += kv_tokens
        else:
            self.prefill_s += seconds

    def metrics(self, used: int, capacity: int, weight_version: int) -> dict[str, float]:
        """rollout/* metrics of the window these counters cover; `used` / `capacity`: the KV pool's tokens now
        / in all."""
        busy = self.prefill_s + self.decode_s
        return {
            "rollout/tokens_per_s": self.output_tokens / busy if busy else 0.0,
            "rollout/prefix_hit_rate": self.cached_prompt_tokens / self.prompt_tokens
            if self.prompt_tokens
            else 0.0,
            "rollout/cache_usage": used / capacity,
            "rollout/cache_usage_peak": self.peak_used_tokens / capacity,
            "rollout/preemptions": float(self.preemptions),
            "rollout/output_tokens": float(self.output_tokens),
            "rollout/prefill_tokens": float(self.prefill_tokens),
            "rollout/prompt_tokens": float(self.prompt_tokens),
            "rollout/cached_prompt_tokens": float(self.cached_prompt_tokens),
            "rollout/prefill_s": self.prefill_s,
            "rollout/decode_s": self.decode_s,
            "rollout/aborted": float(self.aborted),
            "rollout/truncated": float(self.truncated),
            "rollout/dropped_rows": float(self.dropped_rows),
            "rollout/spec_accept_length": (
                1.0 + self.spec_accepted_tokens / self.spec_steps if self.spec_steps else 0.0
            ),
            "rollout/spec_steps": float(self.spec_steps),
            "rollout/spec_draft_tokens": float(self.spec_draft_tokens),
            "rollout/spec_proposed_tokens": float(self.spec_proposed_tokens),
            "rollout/spec_accepted_tokens": float(self.spec_accepted_tokens),
            "rollout/spec_draft_s": self.spec_draft_s,
            "rollout/spec_chained_drafts": float(self.spec_chained_drafts),
            "rollout/spec_gated_steps": float(self.spec_gated_steps),
            "rollout/weight_version": float(weight_version),
            "rollout/device_wait_s": self.device_wait_s,
        }
