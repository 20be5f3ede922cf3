"""The Ray cluster a `placement.mode=ray` run places its actors in, and where each actor goes.

One placement group holds a bundle per trainer rank and, when disaggregated, one per engine. A colocated
engine shares its trainer rank's bundle (and, on GPUs, half of its GPU each): the two then see the same device,
so the rank syncs its engine through CUDA IPC or shared memory. Bundles are packed onto as few nodes as fit.
"""

from __future__ import annotations

import logging
import os
import secrets
from dataclasses import dataclass
from typing import Any

from miles.config import MilesConfig
from miles.errors import MilesUserError

log = logging.getLogger("miles.placement")


def import_ray() -> Any:
    try:
        import ray
    except ImportError as err:
        raise MilesUserError(
            'placement.mode=ray needs Ray: pip install -e ".[ray]" (or pip install "ray>=2.40")'
        ) from err
    return ray


@dataclass(frozen=True)
class Layout:
    """How many of each actor, on what, and which bundle each goes to."""

    trainer_ranks: int
    engines: int
    colocate: bool
    gpus: bool
    cpus_per_actor: float

    @classmethod
    def of(cls, cfg: MilesConfig, gpus: bool) -> Layout:
        placement = cfg.placement
        engines = placement.num_engines or placement.num_processes
        return cls(placement.num_processes, engines, placement.colocate, gpus, placement.cpus_per_actor)

    def bundles(self) -> list[dict[str, float]]:
        per_rank = self.cpus_per_actor * (2 if self.colocate else 1)
        trainer = [{"CPU": per_rank, **({"GPU": 1.0} if self.gpus else {})}] * self.trainer_ranks
        if self.colocate:
            return trainer
        engine = {"CPU": self.cpus_per_actor, **({"GPU": 1.0} if self.gpus else {})}
        return trainer + [engine] * self.engines

    def trainer_bundle(self, rank: int) -> int:
        return rank

    def engine_bundle(self, engine: int) -> int:
        return engine if self.colocate else self.trainer_ranks + engine

    @property
    def gpus_per_actor(self) -> float:
        """Colocated actors take half of their bundle's GPU each (Ray's accounting; both see the whole GPU)."""
        return (0.5 if self.colocate else 1.0) if self.gpus else 0.0

    def sender_of(self, engine: int) -> int:
        """The trainer rank that syncs `engine`: its colocated rank, else rank 0 (the broadcast's root)."""
        return engine if self.colocate else 0


def init_ray(cfg: MilesConfig, cpus_needed: float = 0.0) -> bool:
    """Join the configured cluster, or start a local one; whether it is local (this machine alone)."""
    ray = import_ray()
    address = cfg.placement.ray_address or os.environ.get("RAY_ADDRESS") or None
    if ray.is_initialized():
        return address is None
    options: dict[str, Any] = {"log_to_driver": True, "include_dashboard": False}
    if address is None:  # a local cluster: logical CPUs enough for the run's bundles on a small machine
        needed = max(cpus_needed, _cpus_needed(cfg))
        options["num_cpus"] = max(os.cpu_count() or 1, int(needed + 0.999))
    # Workers import miles from the driver's environment (an editable install or PYTHONPATH).
    ray.init(address=address, **options)
    return address is None


def _cpus_needed(cfg: MilesConfig) -> float:
    placement = cfg.placement
    engines = placement.num_engines or placement.num_processes
    return placement.cpus_per_actor * (placement.num_processes + engines)


def reserve(cfg: MilesConfig, layout: Layout, name: str) -> Any:
    """The run's placement group `name`, ready (its bundles reserved on the cluster)."""
    ray = import_ray()
    from ray.util.placement_group import placement_group

    group = placement_group(layout.bundles(), strategy="PACK", name=name)
    try:
        ray.get(group.ready(), timeout=cfg.weight_sync.timeout_s)
    except Exception as err:
        ray.util.remove_placement_group(group)
        raise MilesUserError(
            f"Ray could not reserve the run's {len(layout.bundles())} bundles {layout.bundles()} within "
            f"{cfg.weight_sync.timeout_s:g} s (cluster resources: {ray.cluster_resources()}); lower "
            "placement.num_processes / num_engines / cpus_per_actor, or add nodes"
        ) from err
    log.info(
        "ray: %d trainer rank(s) and %d engine(s), %s, on %s",
        layout.trainer_ranks,
        layout.engines,
        "colocated" if layout.colocate else "disaggregated",
        "GPUs" if layout.gpus else "CPUs",
    )
    return group


def actor_options(group: Any, bundle: int, cpus: float, gpus: float, name: str) -> dict[str, Any]:
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    strategy = PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=bundle)
    return {"num_cpus": cpus, "num_gpus": gpus, "scheduling_strategy": strategy, "name": name}


def bind_host(host: str) -> str:
    """Where an actor's sockets listen: `host` (127.0.0.1 on a local cluster), else this node's address
    as the cluster sees it."""
    if host:
        return host
    import ray

    return ray.util.get_node_ip_address()


def new_run_name() -> str:
    """What the run's placement group and actors are named by (`ray list actors` shows them)."""
    return f"miles-{secrets.token_hex(4)}"


def new_authkey() -> bytes:
    """The run's key for its sockets between actors (and the handles of shared tensors sent over them)."""
    return secrets.token_bytes(32)


def use_authkey(authkey: bytes) -> None:
    """Every process of the run authenticates with the run's key: torch sends shared CPU tensors as file
    descriptors that the receiver fetches from the sender's process, authenticated with this key."""
    import multiprocessing

    multiprocessing.current_process().authkey = authkey
