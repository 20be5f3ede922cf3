"""Where the engine keeps each streamed tensor, and the check that it holds what was sent.

Shared by the in-process sync and the receiving side of every transport, so both prove the same thing: each
streamed tensor against the place the engine copied it into (Hugging Face names, which the engine takes too,
and a tied `lm_head.weight`, which it skips, are checked against what the engine holds), and every engine
parameter must have been written.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from miles.weight_sync.checksum import fingerprint_on_device

Place = tuple[str, torch.Tensor]
"""(the engine parameter's name, the view of it a streamed tensor goes into)."""


def engine_places(model: torch.nn.Module) -> Callable[[str], Place | None]:
    """A resolver: streamed name -> its place in `model`, or None for a tensor the engine does not keep
    (`rotary_emb.inv_freq`); KeyError for one it has no place for. Names may be the engine model's own
    (`qkv_proj`) or Hugging Face's (`q_proj`, per-expert), as `Engine.update_weights` takes them; a tied
    `lm_head.weight` is the embedding the engine shares it with."""
    params = dict(model.named_parameters(remove_duplicate=False))
    owner = {id(p): n for n, p in model.named_parameters()}  # a tied parameter under its first name
    args = getattr(model, "args", None)

    def place(name: str) -> Place | None:
        if args is None:
            slot: tuple[str, tuple] | None = (name, ())
        else:
            from miles.models.checkpoint import model_slot

            slot = model_slot(name, args)
        if slot is None:
            return None
        target = params.get(slot[0])
        try:
            view = target.detach()[slot[1]]  # type: ignore[union-attr]
        except (AttributeError, IndexError) as err:  # no such parameter, or expert, in the engine
            raise KeyError(name) from err
        return owner.get(id(target), slot[0]), view

    return place


def check_places(
    model: torch.nn.Module,
    expected: dict[str, int],
    places: dict[str, Place | None],
    refused: set[str] = frozenset(),  # type: ignore[assignment]
) -> list[str]:
    """The streamed names the engine refused or whose place in it does not hold them bit for bit, and the
    engine's parameters no streamed tensor went into (the engine would run them stale). Fingerprints are
    computed on the device and read in one transfer."""
    mismatched = [name for name in expected if name in refused]
    covered: set[str] = set()
    checked: list[tuple[str, torch.Tensor]] = []
    for name in expected:
        found = places.get(name)
        if found is None:
            continue
        covered.add(found[0])
        checked.append((name, fingerprint_on_device(found[1])))
    if checked:
        held = torch.stack([f for _, f in checked]).tolist()
        mismatched += [name for (name, _), value in zip(checked, held) if value != expected[name]]
    mismatched += [n for n, _ in model.named_parameters() if n not in covered]
    return sorted(mismatched)
