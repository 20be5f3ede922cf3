"""An RL run placed by Ray (`placement.mode=ray`): the driver (this process) keeps the loop, the data order,
the rewards, the checkpoints' schedule and the logs; trainer rank actors train, engine actors generate.

    driver ── prompts ─▶ router ─▶ engine actors ── samples ─▶ driver (rewards, advantages)
       │                              ▲
       └── samples, per rank ─▶ trainer ranks ── weights (shm / cuda_ipc / broadcast) ──┘

The loop is the embedded placement's (miles/rl/loop.py); only the parts differ: the rollout side's engine is
an `EngineFleet`, the trainer side and the sync call the rank actors, and a checkpoint is written by rank 0.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from miles.build import build_inputs, build_rewards
from miles.config import MilesConfig
from miles.distributed import SINGLE, DataParallel
from miles.placement.engine_process import EngineProcessError, EngineSpec
from miles.placement.ray import engine_actor, trainer_actor
from miles.placement.ray.cluster import (
    Layout,
    actor_options,
    import_ray,
    init_ray,
    new_authkey,
    new_run_name,
    reserve,
    use_authkey,
)
from miles.placement.ray.fleet import EngineFleet
from miles.placement.ray.sides import RaySync, RayTrainerSide, gather_ranks
from miles.rl.checkpointing import schedule_resize
from miles.rl.parts import RLParts, build_collector, build_tracking
from miles.rl.rollout_side import RolloutSide
from miles.tracking import redact

log = logging.getLogger("miles.placement")


@dataclass
class RayParts(RLParts):
    ranks: list[Any] = field(default_factory=list)
    group: Any = None
    """The run's placement group (removed at close)."""

    @property
    def fleet(self) -> EngineFleet:
        return self.rollout.engine

    def load_checkpoint(self) -> int:
        """Every rank loads the checkpoint's weights and optimizer state; the driver its loader position,
        engine state and metrics; then the engines are synced to the checkpoint's weights (by the loop)."""

        assert self.resume_from is not None
        folder, state = self.resume_from.folder, self.resume_from.state
        resize = schedule_resize(self.cfg, folder, state)
        gather_ranks([rank.load_checkpoint.remote(str(folder), resize) for rank in self.ranks], "resuming")
        self.loader.load_state_dict(state.loader)
        self.fleet.load_state_dict(state.engine)
        if self.tracker is not None:
            self.tracker.carry_over(folder.parent.parent, state.step)
        log.info("resumed from %s (step %d)", folder, state.step)
        return state.step

    def save_checkpoint(self, step: int, wandb_run_id: str | None) -> None:

        write_state = {
            "config": redact(asdict(self.cfg)),
            "loader_state": self.collector.loader_state(),
            "engine_state": self.fleet.state_dict(),
            "wandb_run_id": wandb_run_id,
        }
        keep_last = self.cfg.trainer.keep_last
        saving = self.ranks[0].save_checkpoint.remote(str(self.run_dir), step, keep_last, write_state)
        gather_ranks([saving], "saving a checkpoint")

    def close(self) -> None:
        import ray

        try:
            if self.busy is not None:
                self.busy.stop()
            self.collector.close()
            self.rollout.close()  # the rewards' workers
            self.sync.close()  # the senders first: the engines answer their Disconnect
            self.fleet.close()
            if self.tracker is not None:
                self.tracker.close()
        finally:
            for rank in self.ranks:
                ray.kill(rank, no_restart=True)
            if self.group is not None:
                ray.util.remove_placement_group(self.group)


def build_ray_parts(cfg: MilesConfig, run_dir: Path, dp: DataParallel = SINGLE) -> RayParts:
    """The run's actors placed and started, the engines synced to the policy; `dp`: the driver's (one
    process)."""
    assert not dp.enabled, "the Ray driver is one process; its trainer ranks are actors"
    ray = import_ray()
    authkey = new_authkey()
    use_authkey(authkey)
    local = init_ray(cfg)
    layout = Layout.of(cfg, gpus=wants_gpus(cfg))
    run = new_run_name()
    group = reserve(cfg, layout, run)
    try:
        return _build(cfg, run_dir, layout, group, run, authkey, local)
    except BaseException:
        ray.util.remove_placement_group(group)
        raise


def _build(
    cfg: MilesConfig, run_dir: Path, layout: Layout, group: Any, run: str, authkey: bytes, local: bool
) -> RayParts:
    import ray

    rank_class, cpus, gpus = trainer_actor.remote_class(), cfg.placement.cpus_per_actor, layout.gpus_per_actor
    ranks = [
        rank_class.options(
            **actor_options(group, layout.trainer_bundle(r), cpus, gpus, f"{run}-rank-{r}")
        ).remote(r, layout.trainer_ranks, authkey)
        for r in range(layout.trainer_ranks)
    ]
    host = "127.0.0.1" if local else ""  # "": each actor binds its node's address
    engine_class, starts = engine_actor.remote_class(), [0] * layout.engines

    def create(e: int) -> Any:
        starts[e] += 1
        # Named for `ray list actors` and for tests: the run, the engine, and which start of it.
        options = actor_options(group, layout.engine_bundle(e), cpus, gpus, f"{run}-engine-{e}.{starts[e]}")
        return engine_class.options(**options).remote(f"engine-{e}", authkey, host, cfg.weight_sync.timeout_s)

    created = [create(e) for e in range(layout.engines)]
    # The driver reads the data and tokenizer while the actors' processes start (it also holds a CPU copy of
    # the weights, which it does not train).
    inputs = build_inputs(replace(cfg, model=replace(cfg.model, device="cpu")), SINGLE)
    master = ray.get(ranks[0].rendezvous.remote(host))
    setups = [rank.setup.remote(cfg, master) for rank in ranks]
    # A colocated GPU engine sizes its KV pool around its rank's first update.
    reserve_bytes = gather_ranks(setups, "starting")[0] if layout.colocate and layout.gpus else 0
    options = {"bucket_mb": cfg.weight_sync.bucket_mb, "timeout_s": cfg.weight_sync.timeout_s, "host": host}
    sync = RaySync(ranks, layout, {"transport": sync_transport(cfg, layout), **options})
    spec = EngineSpec(
        model_path=cfg.model.path,
        seed=cfg.trainer.seed,
        dtype=cfg.model.dtype,
        device="cuda:0" if layout.gpus else "cpu",
        rollout=cfg.rollout,
        num_threads=cfg.placement.cpu_threads or None,
        reserve_bytes=reserve_bytes,
    )

    def attach(e: int, actor: Any, commands: Any, connecting: Any) -> Any:
        """The driver's handle on engine `e` (started in `actor`), once built: it waits for its trainer
        rank to connect (`connecting`), and counts as dead if that call fails."""
        timeout_s, hang_s = cfg.weight_sync.timeout_s, cfg.placement.engine_hang_s
        try:
            return engine_actor.connect_engine(
                actor, commands, f"engine-{e}", authkey, timeout_s, hang_s, connecting
            )
        except EngineProcessError:  # a dead rank is the cause to report
            gather_ranks([connecting], f"connecting to engine-{e}", [layout.sender_of(e)])
            raise

    def restart(e: int) -> tuple[Any, Any]:
        """Engine `e` anew in its bundle, its rank reconnected and synced (the engine, the sync's result)."""
        actor = create(e)
        commands, sync_address = ray.get(actor.start.remote(spec))
        connecting = sync.connect({e: sync_address})[e]
        engine = attach(e, actor, commands, connecting)
        gather_ranks([connecting], f"connecting to engine-{e}", [layout.sender_of(e)])
        return engine, sync.sync_engine(e)

    addresses = ray.get([actor.start.remote(spec) for actor in created])  # (commands, sync) each
    connecting = sync.connect({e: sync_address for e, (_, sync_address) in enumerate(addresses)})
    reserve_bytes = gather_ranks(setups, "starting")[0]
    engines = [
        attach(e, actor, commands, connecting[e])
        for e, (actor, (commands, _)) in enumerate(zip(created, addresses))
    ]
    calls = {id(call): (call, layout.sender_of(e)) for e, call in connecting.items()}
    gather_ranks([c for c, _ in calls.values()], "connecting to the engines", [r for _, r in calls.values()])
    multiturn = bool(cfg.rollout.generate_fn)  # run by each engine actor: a session stays on its engine
    fleet = EngineFleet(engines, restart, cfg.placement.max_engine_restarts, multiturn)
    sync.fleet = fleet
    first = sync.sync(version=0)  # the engines hold rank 0's weights from here on, checked bit for bit
    if not first.checksum_ok:
        raise RuntimeError(f"the engines did not take the policy's weights: {first.mismatched[:5]}")
    rewards = build_rewards(cfg)
    rollout = RolloutSide(cfg, fleet, rewards, inputs.stop_token_ids, SINGLE, plugin_here=False)
    collector = build_collector(cfg, inputs, rollout, SINGLE)
    resume_from, wandb_run_id, tracker = build_tracking(cfg, run_dir, inputs, SINGLE)
    return RayParts(
        cfg, run_dir, SINGLE, inputs, collector.loader, rollout, collector, RayTrainerSide(ranks, reserve_bytes), sync,
        tracker, None, resume_from, wandb_run_id, inputs.dropped_metrics() if resume_from is None else {},
        ranks=ranks, group=group,
    )  # fmt: skip


def wants_gpus(cfg: MilesConfig) -> bool:
    import ray

    device = cfg.model.device
    if device == "auto":
        return ray.cluster_resources().get("GPU", 0) > 0
    return device.startswith("cuda")


def sync_transport(cfg: MilesConfig, layout: Layout) -> str:
    """`weight_sync.transport` with `auto` resolved: colocated cuda_ipc (GPU) or shm (CPU); else broadcast."""
    transport = cfg.weight_sync.transport
    if transport != "auto":
        return transport
    if not layout.colocate:
        return "broadcast"
    return "cuda_ipc" if layout.gpus else "shm"
