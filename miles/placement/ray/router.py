"""Which engine serves which prompt. A prompt goes whole (all `n` samples of its group) to one engine, so the
group shares one prefill in that engine's radix cache. Among the engines, the least loaded (tokens it has
been given this call) wins, except that a prompt whose leading tokens an engine served before goes back to
that engine while its load is within one prompt's worth of the least loaded: its prefix may still be cached
there.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from miles.sample import Sample

PREFIX_TOKENS = 32
"""Leading tokens that identify a prompt's shared prefix (a system prompt, a few-shot header)."""
REMEMBERED_PREFIXES = 4096


@dataclass
class Router:
    engines: int
    owners: OrderedDict[tuple[int, ...], int] = field(default_factory=OrderedDict)
    """Leading tokens -> the engine that last served them (least recently used dropped first)."""
    groups: list[int] = field(default_factory=list)
    load: list[int] = field(default_factory=list)
    affinity_hits: int = 0
    """Prompts sent to the engine that served their prefix before, since the last `metrics()`."""

    def __post_init__(self) -> None:
        self.groups, self.load = [0] * self.engines, [0] * self.engines

    def assign(self, prompts: list[Sample], n: int, max_new_tokens: int) -> list[list[int]]:
        """Positions in `prompts` for each engine."""
        given = [0] * self.engines
        out: list[list[int]] = [[] for _ in range(self.engines)]
        for position, prompt in enumerate(prompts):
            cost = len(prompt.prompt_ids) + n * max_new_tokens
            key = tuple(prompt.prompt_ids[:PREFIX_TOKENS])
            least = min(range(self.engines), key=lambda e: given[e])
            owner = self.owners.get(key)
            if owner is not None and owner < self.engines and given[owner] <= given[least] + cost:
                engine = owner
                self.affinity_hits += 1
            else:
                engine = least
            out[engine].append(position)
            given[engine] += cost
            self.owners[key] = engine
            self.owners.move_to_end(key)
            if len(self.owners) > REMEMBERED_PREFIXES:
                self.owners.popitem(last=False)
        for engine in range(self.engines):
            self.groups[engine] += len(out[engine])
            self.load[engine] += given[engine]
        return out

    def metrics(self) -> dict[str, float]:
        """Per engine: prompts (groups) and tokens routed to it since the last call."""
        out = {"router/affinity_hits": float(self.affinity_hits)}
        for engine in range(self.engines):
            out[f"router/engine{engine}_groups"] = float(self.groups[engine])
            out[f"router/engine{engine}_load_tokens"] = float(self.load[engine])
        self.groups, self.load, self.affinity_hits = [0] * self.engines, [0] * self.engines, 0
        return out
