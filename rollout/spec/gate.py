"""`SpecGate`: whether a decode step speculates (`rollout.spec_min_accept_length`).

A verify step costs more than a plain one (its k + 1 rows a request, the proposal, and on the GPU the host
work that overlap scheduling would have hidden), so speculation pays only while enough drafts are kept: with
a new or badly matched draft it makes decoding slower. The gate keeps a moving average of the tokens kept
per request and verify step, and lets decode steps run plain while it is below the threshold, speculating
again on one step after `probe_every` plain ones to measure it anew. The drafts' acceptance changes when
weights do (the policy's, or the draft's as it trains), so each probe that leaves the gate closed doubles the
wait before the next (up to 16 times), and a weight update (`reset`) measures again at once. It counts steps,
not time, so its decisions (and with them the run) are reproducible.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SpecGate:
    min_accept_length: float
    """Tokens kept per request and verify step below which decode steps run plain; 0: always speculate."""
    probe_every: int
    """Plain decode steps after which one step speculates again while the gate is closed."""
    weight: float = 0.5
    """Weight of the newest verify step in the moving average."""
    accept_length: float | None = None
    """The moving average of tokens kept per request and verify step (None before the first)."""
    plain_steps: int = 0
    """Decode steps since the last verify step."""
    wait: int = 0
    """Plain decode steps before the next probe (probe_every, doubled by each probe that fails)."""

    def __post_init__(self) -> None:
        if self.min_accept_length < 0 or self.probe_every < 1:
            raise ValueError(
                "rollout.spec_min_accept_length must be >= 0 and rollout.spec_probe_every >= 1, got "
                f"{self.min_accept_length} and {self.probe_every}"
            )
        self.wait = self.probe_every

    @property
    def always(self) -> bool:
        return self.min_accept_length == 0

    def speculate(self) -> bool:
        """Whether the next decode step proposes drafts."""
        if self.always or self.accept_length is None or self.accept_length >= self.min_accept_length:
            return True
        return self.plain_steps >= self.wait

    def record(self, verified: int, accepted: int) -> None:
        """A decode step ran: `verified` requests verified drafts in it and kept `accepted` of them (0, 0 for
        a plain step)."""
        if not verified:
            self.plain_steps += 1
            return
        kept = 1.0 + accepted / verified
        old = self.accept_length
        self.accept_length = kept if old is None else (1.0 - self.weight) * old + self.weight * kept
        if self.accept_length >= self.min_accept_length:
            self.wait = self.probe_every
        elif self.plain_steps:  # a probe, and the gate stays closed
            self.wait = min(2 * self.wait, 16 * self.probe_every)
        self.plain_steps = 0

    def reset(self) -> None:
        """New weights: measure the acceptance again at the next decode step."""
        self.accept_length, self.plain_steps, self.wait = None, 0, self.probe_every
