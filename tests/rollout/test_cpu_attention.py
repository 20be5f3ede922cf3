"""The C decode-attention kernel (rollout/cpu_attention.c) against a float64 softmax, its layout checks, and
its fallback when it cannot be built."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from miles.config import RolloutConfig
from miles.rollout.attention import cpu_kernel
from miles.rollout.engine import Engine
from miles.rollout.sampling.params import SamplingParams
from tests.support.models import tiny_model

BLOCK = cpu_kernel.BLOCK


def _transposed(keys: torch.Tensor, capacity: int) -> torch.Tensor:
    """[N, H, L, D] keys -> the [N, H, L, D] view of a [N, H, D, capacity] tensor (DecodeStaging's layout)."""
    n, h, length, d = keys.shape
    store = torch.full((n, h, d, capacity), float("nan"))  # never read past a row's length
    store[..., :length].copy_(keys.mT)
    return store[..., :length].mT


@pytest.mark.parametrize(("q_per_kv", "dim"), [(1, 16), (2, 16), (4, 64), (8, 128)])
def test_kernel_matches_a_float64_softmax(q_per_kv: int, dim: int) -> None:
    gen = torch.Generator().manual_seed(q_per_kv * dim)
    kv_heads, sizes, prefix_lengths = 2, [3, 1, 5], [20, 16, 37]
    lone = 4  # rows without a shared prefix, after the groups' members
    rows = sum(sizes) + lone
    suffix_lengths = torch.randint(1, 40, (rows,), generator=gen, dtype=torch.int32)
    suffix_lengths[0] = 1
    suffix_lengths[-1] = 33  # one past two whole blocks
    q_heads = kv_heads * q_per_kv
    # q as a slice of a wider projection output, the way the model hands it over.
    q = torch.randn(rows, q_heads + 3, dim, generator=gen)[:, :q_heads]
    p_width, s_width = max(prefix_lengths), int(suffix_lengths.max())
    pk, pv = (torch.randn(len(sizes), kv_heads, p_width, dim, generator=gen) for _ in range(2))
    sk, sv = (torch.randn(rows, kv_heads, s_width, dim, generator=gen) for _ in range(2))
    row_group = torch.tensor(
        [g for g, size in enumerate(sizes) for _ in range(size)] + [-1] * lone, dtype=torch.int32
    )
    plan = cpu_kernel.DecodePlan(suffix_lengths, torch.tensor(prefix_lengths, dtype=torch.int32), row_group)
    scale = dim**-0.5
    out = plan._attend(q, (_transposed(pk, 48), pv), (_transposed(sk, 64), sv), scale)

    expected = torch.empty(rows, kv_heads, q_per_kv, dim, dtype=torch.float64)
    for b in range(rows):
        g, n = int(row_group[b]), int(suffix_lengths[b])
        keys, values = sk[b, :, :n], sv[b, :, :n]
        if g >= 0:
            keys = torch.cat([pk[g, :, : prefix_lengths[g]], keys], dim=1)
            values = torch.cat([pv[g, :, : prefix_lengths[g]], values], dim=1)
        qb = q[b].reshape(kv_heads, q_per_kv, dim).double()
        weights = torch.softmax(qb @ keys.double().mT * scale, dim=-1)
        expected[b] = weights @ values.double()
    torch.testing.assert_close(out.double(), expected, atol=2e-6, rtol=1e-5)


def test_a_nan_score_gives_a_nan_row_as_sdpa_does() -> None:
    keys = torch.randn(2, 1, 20, 16)
    keys[0, 0, 7, 3] = float("nan")
    values = torch.randn(2, 1, 20, 16)
    q = torch.randn(2, 2, 16)
    out = cpu_kernel.DecodePlan(torch.tensor([20, 20], dtype=torch.int32))._attend(
        q, None, (_transposed(keys, 32), values), 0.25
    )
    ref = torch.nn.functional.scaled_dot_product_attention(q[:, None], keys, values, scale=0.25)
    assert out[0].isnan().all() and ref[0].isnan().all()
    torch.testing.assert_close(out[1], ref[1, 0][None], atol=1e-6, rtol=1e-5)


def test_kernel_without_prefixes() -> None:
    gen = torch.Generator().manual_seed(0)
    rows, kv_heads, q_per_kv, dim = 5, 2, 2, 16
    lengths = torch.tensor([1, 16, 17, 3, 64], dtype=torch.int32)
    q = torch.randn(rows, kv_heads * q_per_kv, dim, generator=gen)
    sk, sv = (torch.randn(rows, kv_heads, 64, dim, generator=gen) for _ in range(2))
    out = cpu_kernel.DecodePlan(lengths)._attend(q, None, (_transposed(sk, 64), sv), 0.25)
    for b in range(rows):
        n = int(lengths[b])
        qb = q[b].reshape(kv_heads, q_per_kv, dim)
        ref = torch.softmax(qb @ sk[b, :, :n].mT * 0.25, dim=-1) @ sv[b, :, :n]
        torch.testing.assert_close(out[b], ref, atol=1e-6, rtol=1e-5)


def test_kernel_refuses_layouts_it_cannot_read() -> None:
    rows, dim = 2, 16
    lengths = torch.tensor([3, 20], dtype=torch.int32)
    plan = cpu_kernel.DecodePlan(lengths)
    q = torch.randn(rows, 4, dim)
    sv = torch.randn(rows, 2, 20, dim)
    with pytest.raises(ValueError, match="multiple of 16"):  # key rows not padded to whole blocks
        plan._attend(q, None, (_transposed(torch.randn(rows, 2, 20, dim), 20), sv), 0.25)
    with pytest.raises(ValueError, match="contiguous last dimensions"):  # keys not transposed
        plan._attend(q, None, (torch.randn(rows, 2, 20, dim), sv), 0.25)
    with pytest.raises(ValueError, match="does not fit"):
        plan._attend(
            torch.randn(rows + 1, 4, dim), None, (_transposed(torch.randn(rows, 2, 20, dim), 32), sv), 0.25
        )
    with pytest.raises(ValueError, match="below 0"):
        cpu_kernel.DecodePlan(torch.tensor([3, -5], dtype=torch.int32))
    with pytest.raises(ValueError, match="contiguous 1-d int32"):
        cpu_kernel.DecodePlan(torch.tensor([3, 99, 20, 99], dtype=torch.int32)[::2])
    with pytest.raises(ValueError, match="contiguous 1-d int32"):
        cpu_kernel.DecodePlan(lengths.long())
    # Keys whose rows are block-padded in their strides but whose memory ends right after the longest length.
    tight = torch.randn(15 * 32 + 20).as_strided((1, 1, 16, 20), (512, 512, 32, 1))
    one = cpu_kernel.DecodePlan(torch.tensor([20], dtype=torch.int32))
    with pytest.raises(ValueError, match="outside them"):
        one._attend(torch.randn(1, 2, dim), None, (tight.mT, torch.randn(1, 1, 20, dim)), 0.25)
    with pytest.raises(ValueError, match="group is out of range"):
        cpu_kernel.DecodePlan(
            lengths, torch.tensor([5], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32)
        )


def test_a_failed_build_switches_the_kernel_off(
    tmp_path: object, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(cpu_kernel, "_function", None)
    monkeypatch.setattr(cpu_kernel.kernel, "on", True)
    monkeypatch.setenv("MILES_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "false")  # a compiler that always fails
    plan = cpu_kernel.DecodePlan(torch.tensor([1], dtype=torch.int32))
    sk = _transposed(torch.randn(1, 1, 1, 16), 16)
    with caplog.at_level(logging.WARNING, logger=cpu_kernel.log.name):
        assert plan.attend(torch.randn(1, 2, 16), None, (sk, torch.randn(1, 1, 1, 16)), 0.25) is None
    assert not cpu_kernel.kernel.on
    assert "CPU decode-attention kernel unavailable" in caplog.text
    assert not list(tmp_path.iterdir())  # type: ignore[attr-defined]  # nothing half-built left behind


def test_engine_decodes_through_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU float32 engine runs its group decodes through the kernel, and samples what the flash-attention
    path samples (greedy tokens equal, logprobs to float32 rounding)."""
    model = tiny_model(moe=True)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 96, (n,), generator=gen).tolist() for n in (40, 23, 57)]
    params = SamplingParams(n=4, temperature=0.0, max_new_tokens=30, ignore_eos=True)
    calls = 0
    attend = cpu_kernel.DecodePlan._attend

    def counted(*args: object) -> torch.Tensor:
        nonlocal calls
        calls += 1
        return attend(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(cpu_kernel.DecodePlan, "_attend", counted)
    monkeypatch.setattr(cpu_kernel.kernel, "on", True)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    with_kernel = Engine(model, None, RolloutConfig()).generate(prompts, params)
    assert calls >= 2 * 28  # both layers of (nearly) every decode step
    monkeypatch.setattr(cpu_kernel.kernel, "on", False)
    flash = Engine(model, None, RolloutConfig()).generate(prompts, params)
    for a, b in zip(with_kernel, flash, strict=True):
        assert a.response_ids == b.response_ids
        torch.testing.assert_close(
            torch.tensor(a.rollout_logprobs), torch.tensor(b.rollout_logprobs), atol=1e-5, rtol=0
        )


def test_an_unwritable_cache_builds_in_a_private_folder(
    tmp_path: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    import shutil
    from pathlib import Path

    cpu_kernel._load()  # the library in the usual cache (the other tests of this file build it too)
    reference = cpu_kernel.library_cache() / cpu_kernel.library_name()
    blocker = Path(str(tmp_path)) / "a_file"
    blocker.write_text("")  # the cache folder would have to be inside a file: it cannot be made
    monkeypatch.setattr(cpu_kernel, "_function", None)
    monkeypatch.setattr(cpu_kernel.kernel, "on", True)
    monkeypatch.setenv("MILES_KERNEL_CACHE", str(blocker / "cache"))
    built: list[Path] = []

    def copy_the_built_library(source: Path, out: Path) -> None:
        # Compiling again costs a minute at -O3 on two cores; what is under test is where it goes.
        built.append(out)
        shutil.copy(reference, out)

    monkeypatch.setattr(cpu_kernel, "_build", copy_the_built_library)
    plan = cpu_kernel.DecodePlan(torch.tensor([1], dtype=torch.int32))
    keys, values = torch.randn(1, 1, 1, 16), torch.randn(1, 1, 1, 16)
    out = plan.attend(torch.randn(1, 1, 16), None, (_transposed(keys, 16), values), 0.25)
    assert out is not None and cpu_kernel.kernel.on
    torch.testing.assert_close(out, values[:, :, :1].expand(1, 1, 1, 16))  # one key: its value
    # Built once, in a new folder of this process's own, not under the cache that could not be made.
    assert len(built) == 1 and built[0].parent.name.startswith("miles-kernels-"), built
    assert built[0].parent.stat().st_uid == os.getuid() and not (blocker / "cache").exists()
