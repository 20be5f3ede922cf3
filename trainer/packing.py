"""Packing samples into micro-batches of flattened sequences (no padding) for `CausalLM.forward_packed`.

A sample feeds `prompt_ids + response_ids[:-1]` (the last response token is only ever a target); the
logits at the last prompt position and at every fed response position predict the response tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from miles.sample import Sample


def fed_length(sample: Sample) -> int:
    """Tokens a sample feeds to the model: prompt plus all response tokens but the last."""
    return len(sample.prompt_ids) + len(sample.response_ids) - 1


def response_loss_mask(sample: Sample) -> list[int]:
    """The sample's loss mask; an empty one means every response token counts."""
    if not sample.loss_mask:
        return [1] * len(sample.response_ids)
    return list(sample.loss_mask)


def validate_sample(sample: Sample, position: int) -> None:
    where = f"sample {position} (group {sample.group_id}, index {sample.index})"
    if not sample.prompt_ids:
        raise ValueError(
            f"{where} has no prompt_ids; the first response token needs a prompt to be predicted from"
        )
    if not sample.response_ids:
        raise ValueError(f"{where} has no response_ids; drop empty responses before training")
    if sample.loss_mask and len(sample.loss_mask) != len(sample.response_ids):
        raise ValueError(
            f"{where}: loss_mask has {len(sample.loss_mask)} entries for {len(sample.response_ids)} response tokens"
        )
    if sample.rollout_logprobs and len(sample.rollout_logprobs) != len(sample.response_ids):
        raise ValueError(
            f"{where}: rollout_logprobs has {len(sample.rollout_logprobs)} entries for "
            f"{len(sample.response_ids)} response tokens"
        )


def plan_micro_batches(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Group item indices so each group's total length is <= max_tokens (first-fit decreasing).

    An item longer than `max_tokens` gets a micro-batch of its own rather than failing the step.
    Indices inside a group are ascending, and groups are ordered by their first index, so the plan is
    deterministic.
    """
    if max_tokens <= 0:
        raise ValueError(f"micro_batch_tokens must be positive, got {max_tokens}")
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda j: (-lengths[j], j)):
        for b, load in enumerate(loads):
            if load + lengths[i] <= max_tokens:
                bins[b].append(i)
                loads[b] += lengths[i]
                break
        else:
            bins.append([i])
            loads.append(lengths[i])
    return sorted((sorted(b) for b in bins), key=lambda b: b[0])


@dataclass
class MicroBatch:
    sample_ids: list[int]
    """Positions, in the caller's sample list, of the packed samples (in packing order)."""
    input_ids: torch.Tensor
    """[N] fed tokens of all packed samples."""
    positions: torch.Tensor
    """[N] position of each token within its own sequence."""
    cu_seqlens: list[int]
    """Cumulative fed lengths [0, n0, n0+n1, ...]."""
    target_rows: torch.Tensor
    """[M] rows of the packed hidden states whose logits predict the response tokens."""
    targets: torch.Tensor
    """[M] the response tokens."""
    seq_index: torch.Tensor
    """[M] which packed sample (0..len(sample_ids)-1) each response token belongs to."""
    response_lengths: list[int]
    routing_replay: torch.Tensor | None = None
    """[num_moe_layers, N, top_k] expert ids recorded at rollout, when routing replay is on."""

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    def per_sample(self, values: torch.Tensor) -> list[torch.Tensor]:
        """Split an [M] per-response-token tensor into one tensor per packed sample."""
        return list(torch.split(values, self.response_lengths))


def _routing_tensor(sample: Sample, position: int) -> torch.Tensor:
    if sample.routed_experts is None:
        raise ValueError(
            f"routing replay is on but sample {position} has no routed_experts; "
            "set rollout.record_routing=true or trainer.routing_replay=false"
        )
    routing = torch.as_tensor(sample.routed_experts).long()  # an int16 tensor (the engine's) or nested lists
    expected = fed_length(sample)
    # The engine may also record the routing of the final sampled token if it fed it; it is never a target.
    if routing.dim() != 3 or routing.shape[0] not in (expected, expected + 1):
        raise ValueError(
            f"sample {position}: routed_experts has shape {tuple(routing.shape)}; expected "
            f"[{expected} fed tokens (prompt + response minus the last), num_moe_layers, top_k]"
        )
    return routing[:expected]


def build_micro_batch(
    samples: list[Sample], sample_ids: list[int], device: torch.device, routing_replay: bool = False
) -> MicroBatch:
    chosen = [samples[i] for i in sample_ids]
    count = len(chosen)
    prompt_lens = np.fromiter((len(s.prompt_ids) for s in chosen), np.int64, count)
    response_lens = np.fromiter((len(s.response_ids) for s in chosen), np.int64, count)
    fed_lens = prompt_lens + response_lens - 1
    cu_seqlens = np.zeros(count + 1, np.int64)
    np.cumsum(fed_lens, out=cu_seqlens[1:])
    fed: list[int] = []
    targets: list[int] = []
    for sample in chosen:
        fed.extend(sample.prompt_ids)
        fed.extend(sample.response_ids[:-1])
        targets.extend(sample.response_ids)
    n, m = int(cu_seqlens[-1]), int(response_lens.sum())
    # Per-token arrays worked out on the host and sent in one copy (a tensor each from Python lists cost a
    # small model's update ~4 ms of host time at 256 samples, and a copy each).
    response_starts = np.cumsum(response_lens) - response_lens  # where each sample's targets begin
    packed = np.empty(2 * n + 3 * m, np.int64)
    packed[:n] = fed
    packed[n : 2 * n] = np.arange(n) - np.repeat(cu_seqlens[:-1], fed_lens)  # position within its sequence
    # The row predicting a sample's first response token is its last prompt position.
    first_rows = cu_seqlens[:-1] + prompt_lens - 1
    packed[2 * n : 2 * n + m] = np.arange(m) + np.repeat(first_rows - response_starts, response_lens)
    packed[2 * n + m : 2 * n + 2 * m] = targets
    packed[2 * n + 2 * m :] = np.repeat(np.arange(count), response_lens)
    input_ids, positions, target_rows, target_ids, seq_index = torch.split(
        torch.from_numpy(packed).to(device), [n, n, m, m, m]
    )
    replay = None
    if routing_replay:
        routings = [_routing_tensor(samples[i], i) for i in sample_ids]
        replay = torch.cat(routings, dim=0).permute(1, 0, 2).contiguous().to(device)
    return MicroBatch(
        sample_ids=list(sample_ids),
        input_ids=input_ids,
        positions=positions,
        cu_seqlens=cu_seqlens.tolist(),
        target_rows=target_rows,
        targets=target_ids,
        seq_index=seq_index,
        response_lengths=response_lens.tolist(),
        routing_replay=replay,
    )


def pack(
    samples: list[Sample],
    sample_ids: list[int],
    max_tokens: int,
    device: torch.device,
    routing_replay: bool = False,
) -> list[MicroBatch]:
    """Micro-batches of at most `max_tokens` fed tokens covering `samples[i] for i in sample_ids`."""
    plan = plan_micro_batches([fed_length(samples[i]) for i in sample_ids], max_tokens)
    return [
        build_micro_batch(samples, [sample_ids[j] for j in group], device, routing_replay) for group in plan
    ]
