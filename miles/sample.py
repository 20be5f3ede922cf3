"""`Sample`: the one record every stage of an RL step reads and extends (see DESIGN.md)."""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


class SampleStatus(enum.StrEnum):
    PENDING = "pending"
    COMPLETED = "completed"  # stopped on EOS / a stop id / a stop string
    TRUNCATED = "truncated"  # hit max_new_tokens or the context length
    ABORTED = "aborted"  # aborted by the caller or failed (see metadata["error"])


@dataclass
class Sample:
    prompt: str | list[dict[str, Any]] = ""
    """Prompt as text or chat messages."""
    prompt_ids: list[int] = field(default_factory=list)
    response_ids: list[int] = field(default_factory=list)
    response_text: str = ""
    rollout_logprobs: list[float] = field(default_factory=list)
    """Engine logprob of each response token under the sampling distribution actually used."""
    loss_mask: list[int] = field(default_factory=list)
    """1 for response tokens the policy produced, 0 for tokens it must not learn (tool output)."""
    reward: float = 0.0
    reward_info: dict[str, Any] = field(default_factory=dict)
    advantage: float = 0.0
    group_id: int = 0
    """Index of the prompt in the rollout batch; the `n` samples of one prompt share it."""
    index: int = 0
    """Index of the sample within its group."""
    label: Any = None
    """Ground truth from the dataset row (e.g. the final answer)."""
    metadata: dict[str, Any] = field(default_factory=dict)
    status: SampleStatus = SampleStatus.PENDING
    weight_version: int = 0
    routed_experts: torch.Tensor | None = None
    """MoE routing at rollout, for routing replay: an int16 CPU tensor [tokens fed to the model (prompt, then
    response minus the last token), moe layers, top-k expert ids] (nested lists are accepted too)."""
    spec_stats: dict[str, Any] = field(default_factory=dict)
    top_logprobs: list[list[tuple[int, float]]] | None = None
    """Per response token, the most likely tokens and their logprobs (`SamplingParams.top_logprobs` > 0)."""

    @property
    def response_length(self) -> int:
        return len(self.response_ids)

    @property
    def data_source(self) -> str:
        return str(self.metadata.get("data_source", ""))

    def to_dict(self) -> dict[str, Any]:
        record = asdict(self)
        record["status"] = self.status.value
        if hasattr(self.routed_experts, "tolist"):  # JSON-able: nested lists
            record["routed_experts"] = self.routed_experts.tolist()  # type: ignore[union-attr]
        return record

    @classmethod
    def from_dict(cls, record: dict[str, Any]) -> Sample:
        known = {f for f in cls.__dataclass_fields__}
        values = {k: v for k, v in record.items() if k in known}
        if "status" in values:
            values["status"] = SampleStatus(values["status"])
        if values.get("routed_experts") is not None:
            import torch

            values["routed_experts"] = torch.tensor(values["routed_experts"], dtype=torch.int16)
        return cls(**values)
