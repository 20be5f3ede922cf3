"""`placement.mode=ray` on one GPU: a trainer rank and its colocated engine actor share the GPU, the rank syncs
the engine through CUDA IPC, and the run repeats the embedded one on the same GPU."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.support.cli import run_miles
from tests.support.placements import SAME_ON_EVERY_PLACEMENT, SHORT_GRPO
from tests.support.placements import records as _records

pytest.importorskip("ray")
pytestmark = pytest.mark.gpu

ON_GPU = [*SHORT_GRPO, "model.device=cuda", "rollout.backend=torch"]


def test_a_colocated_ray_run_on_one_gpu_syncs_over_cuda_ipc_and_repeats_the_embedded_run(
    tmp_path: Path,
) -> None:
    embedded = run_miles(tmp_path, *ON_GPU, run_dir=tmp_path / "embedded")
    assert embedded.returncode == 0, embedded.stderr[-3000:]
    ray_run = run_miles(tmp_path, *ON_GPU, "placement=ray", run_dir=tmp_path / "ray")
    assert ray_run.returncode == 0, ray_run.stderr[-3000:]
    want, got = _records(tmp_path / "embedded"), _records(tmp_path / "ray")
    assert [r["step"] for r in got] == [r["step"] for r in want] == [0, 1, 2, 3]
    for step in (1, 2, 3):
        assert got[step]["sync/transport"] == 1.0  # cuda_ipc: the engine reads the rank's GPU buffers
        assert got[step]["sync/checksum_ok"] == 1.0
        assert got[step]["sync/replicas_equal"] == 1.0
    # The first step's rollout and update come from the same weights and seeds as the embedded run's.
    for key in SAME_ON_EVERY_PLACEMENT:
        assert math.isclose(got[1][key], want[1][key], rel_tol=1e-4, abs_tol=1e-4), key
