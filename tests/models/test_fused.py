"""`miles.models.fused`: eager by default, compiled only inside `fused_kernels()`, eager again if compiling fails."""

from __future__ import annotations

import logging

import pytest
import torch

from miles.models import fused
from miles.models.attention import KVWrite


@pytest.fixture(autouse=True)
def _fresh_state(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fused, "_compiled", {})
    monkeypatch.setattr(fused, "_failed", False)


def test_outside_the_block_nothing_is_compiled(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_compile(*args: object, **kwargs: object) -> None:
        raise AssertionError("torch.compile must not be called outside fused_kernels()")

    monkeypatch.setattr(torch, "compile", no_compile)
    x = torch.randn(3, 8)
    assert torch.equal(fused.call(fused.silu_mul, x, x), torch.nn.functional.silu(x) * x)
    with fused.fused_kernels(False):
        fused.call(fused.rms_norm, x, torch.ones(8), 1e-6)


def test_a_failed_compile_falls_back_to_eager_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    compiled_calls = []

    def broken_compile(fn: object, **kwargs: object) -> object:
        def run(*args: object) -> None:
            compiled_calls.append(fn)
            raise RuntimeError("no triton here")

        return run

    monkeypatch.setattr(torch, "compile", broken_compile)
    x, w = torch.randn(4, 16), torch.randn(16)
    with caplog.at_level(logging.WARNING, logger="miles.models.fused"), fused.fused_kernels():
        first = fused.call(fused.rms_norm, x, w, 1e-6)
        second = fused.call(fused.rms_norm, x, w, 1e-6)
    assert torch.equal(first, fused.rms_norm(x, w, 1e-6)) and torch.equal(second, first)
    assert len(compiled_calls) == 1, "after one failure the eager kernels are used directly"
    assert "fused kernels unavailable" in caplog.text


def test_a_kernel_switch_turns_off_after_one_failure_but_not_for_out_of_memory(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A Triton kernel that cannot run here fails once, warns once, and is not tried again (its callers take
    the fallback); running out of memory is raised to the caller and leaves the kernel on."""
    calls: list[str] = []

    def kernel(kind: str, scale: int = 1) -> int:
        calls.append(kind)
        if kind == "oom":
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")
        if kind == "broken":
            raise RuntimeError("no Triton compiler")
        return 7 * scale

    switch = fused.KernelSwitch("test kernel", "using the eager function")
    assert switch.run(kernel, "ok", scale=2) == 14
    with pytest.raises(torch.cuda.OutOfMemoryError):
        switch.run(kernel, "oom")
    assert switch.on
    with caplog.at_level(logging.WARNING, logger="miles.models.fused"):
        assert switch.run(kernel, "broken") is None
        assert switch.run(kernel, "ok") is None
    assert not switch.on and calls == ["ok", "oom", "broken"]
    assert caplog.text.count("test kernel unavailable (RuntimeError: no Triton compiler)") == 1
    assert "using the eager function" in caplog.text


def test_add_rms_norm_is_the_residual_add_then_the_norm() -> None:
    x, delta, w = torch.randn(5, 32), torch.randn(5, 32), torch.randn(32)
    total, normed = fused.add_rms_norm(x, delta, w, 1e-6)
    assert torch.equal(total, x + delta)
    assert torch.equal(normed, fused.rms_norm(x + delta, w, 1e-6))


def test_add_slot_sum_rms_norm_is_the_slot_sum_then_the_norm() -> None:
    gen = torch.Generator().manual_seed(0)
    x, slots, w = (torch.randn(*shape, generator=gen).bfloat16() for shape in ((5, 32), (5, 8, 32), (32,)))
    total, normed = fused.add_slot_sum_rms_norm(x, slots, w, 1e-6)
    assert torch.equal(total, fused.add_slot_sum(x, slots))
    torch.testing.assert_close(total, x + slots.float().sum(dim=1).bfloat16())  # summed in float32
    assert torch.equal(normed, fused.rms_norm(total, w, 1e-6))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qk_norm_rope_is_each_heads_norm_then_rope(dtype: torch.dtype) -> None:
    """q and k normed and rotated side by side give exactly what the two separate calls give."""
    q, k = torch.randn(7, 4, 16, dtype=dtype), torch.randn(7, 2, 16, dtype=dtype)
    wq, wk = torch.randn(16, dtype=dtype), torch.randn(16, dtype=dtype)
    cos, sin = torch.randn(7, 16, dtype=dtype), torch.randn(7, 16, dtype=dtype)
    both = fused.qk_norm_rope(torch.cat((q, k), dim=1), wq, wk, 4, 1e-6, cos, sin)
    assert torch.equal(both[:, :4], fused.rms_norm_rope(q, wq, 1e-6, cos, sin))
    assert torch.equal(both[:, 4:], fused.rms_norm_rope(k, wk, 1e-6, cos, sin))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_inference_form_of_qk_norm_rope_gives_the_same_bits(dtype: torch.dtype) -> None:
    """Scaling each head group in place (no autograd) is the same product per element as the expanded weight."""
    qk = torch.randn(9, 8, 16, dtype=dtype)[:, 1:7]  # strided, as the layer's view of its QKV output is
    wq, wk = torch.randn(16, dtype=dtype), torch.randn(16, dtype=dtype)
    cos, sin = torch.randn(9, 16, dtype=dtype), torch.randn(9, 16, dtype=dtype)
    expected = fused.qk_norm_rope(qk, wq, wk, 4, 1e-6, cos, sin)
    assert torch.equal(fused.qk_norm_rope_inference(qk, wq, wk, 4, 1e-6, cos, sin), expected)


def test_qk_norm_rope_with_float32_weights_on_bf16_rows_is_the_same_without_autograd() -> None:
    """Autocast training keeps float32 norm weights beside bf16 activations: the product promotes to float32,
    so the no-grad forwards (old and reference logprobs) must not take the in-place bf16 form."""
    from miles.models import fused_norm_rope

    qk = torch.randn(5, 6, 16, dtype=torch.bfloat16)
    wq, wk = torch.randn(16), torch.randn(16)
    cos, sin = torch.randn(5, 16, dtype=torch.bfloat16), torch.randn(5, 16, dtype=torch.bfloat16)
    with torch.no_grad():
        no_grad = fused_norm_rope.qk_norm_rope(qk, wq, wk, 4, 1e-6, cos, sin)
    assert torch.equal(no_grad, fused.qk_norm_rope(qk, wq, wk, 4, 1e-6, cos, sin))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_rope_rows_come_from_a_table_with_the_same_bits(dtype: torch.dtype) -> None:
    from miles.models.layers import RotaryEmbedding
    from miles.models.presets import preset_args

    rope = RotaryEmbedding(preset_args("qwen3", "qwen3-8b"))
    positions = torch.cat([torch.randint(0, rope.max_positions, (500,)), torch.tensor([0, 40959])])
    cos, sin = rope(positions, dtype)
    assert dtype in rope._cpu_tables
    ref_cos, ref_sin = rope.angles(positions, dtype)
    assert torch.equal(cos, ref_cos) and torch.equal(sin, ref_sin)
    past = torch.tensor([3, rope.max_positions + 5])  # a trainer's forward may go past the context
    assert torch.equal(rope(past, dtype)[0], rope.angles(past, dtype)[0])
    with torch.enable_grad():  # the table is made outside inference mode: training forwards can use it
        x = torch.randn(2, 1, 128, requires_grad=True)
        (x * rope(torch.tensor([1, 2]), torch.float32)[0][:, None]).sum().backward()
    assert x.grad is not None


def test_an_input_error_is_raised_and_keeps_fusion_on(monkeypatch: pytest.MonkeyPatch) -> None:
    def failing_compile(fn: object, **kwargs: object) -> object:
        def run(*args: object) -> None:
            raise RuntimeError("shape mismatch in the compiled kernel")

        return run

    monkeypatch.setattr(torch, "compile", failing_compile)
    with fused.fused_kernels(), pytest.raises(RuntimeError):
        fused.call(fused.silu_mul, torch.randn(3, 4), torch.randn(5, 4))  # eager fails as well
    assert not fused._failed


def test_qk_norm_rope_dispatch_off_cuda_and_the_layouts_the_kernel_takes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The Triton q/k kernel takes the attention layer's own bf16 tensors (else the engine would silently run
    the compiled function); off CUDA the compiled function runs."""
    from miles.models import fused_norm_rope
    from tests.support.models import tiny_model

    model = tiny_model().to(torch.bfloat16)
    attn = model.model.layers[0].self_attn
    n, heads, dim = 5, attn.num_heads + attn.num_kv_heads, attn.head_dim
    qkv = torch.randn(n, (heads + attn.num_kv_heads) * dim, dtype=torch.bfloat16)
    qk = qkv[:, : heads * dim].view(n, heads, dim)  # a strided view, as the layer passes it
    cos, sin = model.model.rotary_emb(torch.arange(n), torch.bfloat16)
    wq, wk = attn.q_norm.weight, attn.k_norm.weight
    assert fused_norm_rope.shapes_fit(qk, wq, wk, cos, sin)
    assert not fused_norm_rope.shapes_fit(qk, wq, wk, cos.float(), sin)
    assert not fused_norm_rope.shapes_fit(qk, wq, wk, cos[:1], sin[:1])
    assert not fused_norm_rope.shapes_fit(qk[..., :12], wq[:12], wk[:12], cos[:, :12], sin[:, :12])  # half 6
    calls = []
    monkeypatch.setattr(fused, "call", lambda fn, *args: calls.append(fn) or fn(*args))
    with torch.no_grad(), fused.fused_kernels():
        assert not fused_norm_rope.applies(qk, wq, wk, cos, sin)
        out = fused_norm_rope.qk_norm_rope(qk, wq, wk, attn.num_heads, attn.q_norm.eps, cos, sin)
    assert calls == [fused.qk_norm_rope]
    assert torch.equal(out, fused.qk_norm_rope(qk, wq, wk, attn.num_heads, attn.q_norm.eps, cos, sin))
    # The KV-writing variant: the caches it can write, and off CUDA it declines (the caller writes instead).
    v = qkv[:, heads * dim :].view(n, attn.num_kv_heads, dim)
    caches = torch.zeros(2, 4, 16, attn.num_kv_heads, dim, dtype=torch.bfloat16)
    write = KVWrite(caches[0], caches[1], torch.arange(n) + 16)
    assert fused_norm_rope.cache_fits(qk, v, attn.num_heads, write)
    assert not fused_norm_rope.cache_fits(
        qk, v, attn.num_heads, KVWrite(caches[0].float(), caches[1], write.slots)
    )
    assert not fused_norm_rope.cache_fits(
        qk, v, attn.num_heads, KVWrite(caches[0], caches[1], write.slots[:2])
    )
    assert not fused_norm_rope.cache_fits(qk, v[:, :1], attn.num_heads, write)
    mismatched = KVWrite(caches[0], caches[1, :2], write.slots)  # k and v caches of different shapes
    assert not fused_norm_rope.cache_fits(qk, v, attn.num_heads, mismatched)
    narrow = KVWrite(caches[0, ..., :8], caches[1, ..., :8], write.slots)  # not [..., Hk, D]
    assert not fused_norm_rope.cache_fits(qk, v, attn.num_heads, narrow)
    with torch.no_grad(), fused.fused_kernels():
        assert (
            fused_norm_rope.qk_norm_rope_into_cache(qk, v, wq, wk, attn.num_heads, 1e-6, cos, sin, write)
            is None
        )


def test_moe_tile_tables_round_trip_through_json_and_bad_files_say_what_is_wrong(tmp_path) -> None:
    import json

    from miles.models import fused_moe

    path = tmp_path / "tiles.json"
    tuned = fused_moe.TileTables(
        gate_up=[
            (12.0, fused_moe.TileConfig(32, 128, 64, 8, 4, True)),
            *fused_moe.DEFAULT_TABLES.gate_up[2:],
        ],
        down=[(12.0, fused_moe.TileConfig(16, 256, 64, 4, 3)), *fused_moe.DEFAULT_TABLES.down[2:]],
    )
    path.write_text(json.dumps(fused_moe.tables_to_json(tuned)))
    loaded = fused_moe.load_tables(str(path))
    assert loaded == tuned
    assert fused_moe.pick(loaded.gate_up, 12.0).tma and not fused_moe.pick(loaded.gate_up, 12.5).tma
    bad = fused_moe.tables_to_json(tuned)
    bad["down"][-1]["max_pairs_per_expert"] = 99.0  # no entry for larger batches
    with pytest.raises(ValueError, match="end with null"):
        fused_moe.tables_from_json(bad, "tiles.json")
    bad = fused_moe.tables_to_json(tuned)
    bad["gate_up"][0]["block_size"] = 16
    with pytest.raises(ValueError, match="block_size"):
        fused_moe.tables_from_json(bad, "tiles.json")
    with pytest.raises(ValueError, match="'down'"):
        fused_moe.tables_from_json({"gate_up": fused_moe.tables_to_json(tuned)["gate_up"]}, "tiles.json")
