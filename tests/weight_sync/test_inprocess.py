from __future__ import annotations

import torch

from miles.models import CausalLM, ModelArgs
from miles.weight_sync import InProcessWeightSync, compare, fingerprints, iter_buckets, tensor_fingerprint


def tiny_model(seed: int = 0) -> CausalLM:
    torch.manual_seed(seed)
    model = CausalLM(
        ModelArgs(
            model_type="qwen3_moe",
            vocab_size=32,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=8,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=8,
        )
    )
    model.init_weights()
    return model


def test_fingerprint_catches_a_single_flipped_bit() -> None:
    t = torch.randn(1000)
    before = tensor_fingerprint(t)
    bits = t.view(torch.int32)
    bits[517] ^= 1  # lowest mantissa bit of one element
    assert tensor_fingerprint(t) != before
    swapped = torch.randn(10)
    perm = swapped[[1, 0, *range(2, 10)]]
    assert tensor_fingerprint(swapped) != tensor_fingerprint(perm)


def test_compare_names_the_corrupted_tensor() -> None:
    model = tiny_model()
    expected = fingerprints(model.named_parameters())
    with torch.no_grad():
        model.model.layers[1].mlp.experts.down_proj[2, 3, 4] += 1e-3
    assert compare(expected, fingerprints(model.named_parameters())) == [
        "model.layers.1.mlp.experts.down_proj"
    ]


class CopyingEngine:
    """The engine side of a sync that cannot share tensors: its own model, weights copied in buckets."""

    def __init__(self, model: CausalLM) -> None:
        self.model, self.weight_version, self.buckets = model, 0, 0

    def update_weights(self, buckets, version: int) -> None:
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for bucket in buckets:
                self.buckets += 1
                for name, tensor in bucket:
                    params[name].copy_(tensor)
        self.weight_version = version


def test_copying_sync_agrees_and_detects_corruption() -> None:
    trainer, engine_model = tiny_model(0), tiny_model(1)
    engine = CopyingEngine(engine_model)
    sync = InProcessWeightSync(trainer, engine, bucket_bytes=4096)
    assert not sync.shares_weights
    result = sync.sync(version=3)
    assert result.checksum_ok and engine.weight_version == 3 and engine.buckets > 1
    assert result.bytes == sum(p.numel() * 4 for p in trainer.parameters())

    class DroppingEngine(CopyingEngine):
        def update_weights(self, buckets, version: int) -> None:
            super().update_weights([b[1:] for b in buckets], version)  # loses the first tensor of each bucket

    with torch.no_grad():
        for p in trainer.parameters():
            p.add_(0.01)
    bad = InProcessWeightSync(trainer, DroppingEngine(tiny_model(2)), bucket_bytes=4096).sync(version=4)
    assert not bad.checksum_ok and bad.mismatched


def test_buckets_respect_the_size_limit() -> None:
    named = [(f"t{i}", torch.zeros(100)) for i in range(10)]
    buckets = list(iter_buckets(named, bucket_bytes=1000))
    assert [len(b) for b in buckets] == [2] * 5
    assert [n for b in buckets for n, _ in b] == [n for n, _ in named]


def test_converted_weights_stream_through_one_bucket_at_a_time() -> None:
    # a trainer with its own model definition (the megatron backend) hands its converted tensors over as a
    # stream: the sync never holds more than a bucket of them, and still checks every one
    trainer, engine = tiny_model(0), CopyingEngine(tiny_model(1))
    produced: list[int] = []

    class Converting(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = trainer

        def iter_engine_weights(self):
            for name, param in trainer.named_parameters():
                produced.append(engine.buckets)  # how many buckets the engine had taken by then
                yield name, param.detach() * 1.0  # a converted copy

    result = InProcessWeightSync(Converting(), engine, bucket_bytes=4096).sync(version=1)
    assert result.checksum_ok and engine.buckets > 2
    # each tensor was converted while the engine was at most a bucket behind the one it goes into (bucket
    # b is handed over once the first tensor of b + 1 is in hand), never a whole model behind
    named = [(n, p.detach()) for n, p in trainer.named_parameters()]
    bucket_of = [b for b, bucket in enumerate(iter_buckets(named, 4096), start=1) for _ in bucket]
    assert len(bucket_of) == len(produced) and bucket_of[-1] == engine.buckets
    assert all(b - p <= 2 for b, p in zip(bucket_of, produced)), list(zip(bucket_of, produced))
    assert result.fingerprints == fingerprints(trainer.named_parameters())


def test_a_fingerprint_does_not_depend_on_the_chunks_it_is_summed_in() -> None:
    gen = torch.Generator().manual_seed(0)
    for tensor in (
        torch.randn(1000, generator=gen),
        torch.randn(37, 11, generator=gen).to(torch.bfloat16),
        torch.randint(-128, 127, (999,), generator=gen, dtype=torch.int8),
    ):
        flat = tensor.contiguous().view(-1)
        bits = flat.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[flat.element_size()]).to(
            torch.int64
        )
        whole = int((bits * (torch.arange(1, bits.numel() + 1) % 1_000_003 + 1)).sum())  # one pass
        assert {tensor_fingerprint(tensor, chunk) for chunk in (1, 7, 64, 10**6)} == {whole}


def test_a_sync_over_shared_weights_reads_them_only_for_the_replicas() -> None:
    trainer = tiny_model(0)
    engine = CopyingEngine(trainer)  # the engine runs the trainer's own module
    alone = InProcessWeightSync(trainer, engine, replica_fingerprints=False).sync(version=2)
    assert alone.checksum_ok and alone.fingerprints == {} and engine.weight_version == 2
    replicated = InProcessWeightSync(trainer, engine, replica_fingerprints=True).sync(version=3)
    assert replicated.fingerprints == fingerprints(trainer.named_parameters())


def test_fingerprint_catches_any_single_flipped_bit_in_any_dtype() -> None:
    """Every bit of the first element, the last element of a chunk and the last element, in every dtype
    (float64's sign bit times an even position weight used to wrap to 0 modulo 2**64), and tensors of one
    element."""
    gen = torch.Generator().manual_seed(0)
    chunk = 8
    for dtype in (torch.float64, torch.int64, torch.float32, torch.bfloat16, torch.float16, torch.int8):
        for numel in (1, 2, 19):
            base = (torch.randn(numel, generator=gen, dtype=torch.float64) * 100).to(dtype)
            before = {c: tensor_fingerprint(base, c) for c in (chunk, 10**6)}
            assert len(set(before.values())) == 1
            width = base.element_size() * 8
            view = {8: torch.int8, 16: torch.int16, 32: torch.int32, 64: torch.int64}[width]
            for index in sorted({0, chunk - 1, numel - 1} & set(range(numel))):
                for bit in range(width):
                    flipped = base.clone()
                    flipped.view(view)[index] ^= torch.tensor(1, dtype=view) << bit
                    for c in (chunk, 10**6):
                        assert tensor_fingerprint(flipped, c) != before[c], (dtype, numel, index, bit, c)
    assert tensor_fingerprint(torch.zeros(0)) == tensor_fingerprint(torch.zeros(0, dtype=torch.float64)) == 0


class LoadingEngine:
    """The engine side as the real engine loads weights (`miles.rollout.weights.load_weights`): Hugging Face
    names or the model's own, a tied `lm_head.weight` skipped, casts to the engine's dtype."""

    def __init__(self, model: CausalLM, corrupt: str | None = None) -> None:
        self.model, self.weight_version, self.corrupt = model, 0, corrupt

    def update_weights(self, buckets, version: int) -> None:
        from miles.rollout.weights import load_weights

        load_weights(self.model, buckets)
        if self.corrupt is not None:
            with torch.no_grad():
                dict(self.model.named_parameters())[self.corrupt].view(-1)[-1] += 1.0
        self.weight_version = version


class Streaming(torch.nn.Module):
    """A trainer that hands the engine a stream of (name, tensor) of its own choosing."""

    def __init__(self, stream) -> None:
        super().__init__()
        self.stream = stream

    def iter_engine_weights(self):
        return iter(self.stream())


def test_a_sync_in_hugging_face_names_checks_each_tensor_against_its_place_in_the_engine() -> None:
    """`update_weights` takes Hugging Face names (q/k/v_proj, per-expert gate/up/down) as well as the
    model's stacked ones: a stream in those names must verify (it used to be reported all mismatched),
    and a corrupted engine tensor must still be caught, under the Hugging Face name that went into it."""
    from miles.models.checkpoint import internal_to_hf

    trainer = tiny_model(0)

    def hf_stream():
        return internal_to_hf({n: p.detach() for n, p in trainer.named_parameters()}, trainer.args)

    engine = LoadingEngine(tiny_model(1))
    result = InProcessWeightSync(Streaming(hf_stream), engine, bucket_bytes=300).sync(version=5)
    assert result.checksum_ok and result.mismatched == [] and engine.weight_version == 5
    assert all(torch.equal(a, b) for a, b in zip(trainer.parameters(), engine.model.parameters()))
    # bytes moved: every tensor once (HF parts add up to the stacked parameters)
    assert result.bytes == sum(p.numel() * 4 for p in trainer.parameters())

    bad = LoadingEngine(tiny_model(1), corrupt="model.layers.1.mlp.experts.gate_up_proj")
    result = InProcessWeightSync(Streaming(hf_stream), bad, bucket_bytes=300).sync(version=6)
    assert result.mismatched == ["model.layers.1.mlp.experts.3.up_proj.weight"]

    # a stream that leaves an engine parameter out: that parameter would run stale
    def partial():
        return [(n, t) for n, t in hf_stream() if not n.endswith("post_attention_layernorm.weight")]

    result = InProcessWeightSync(Streaming(partial), LoadingEngine(tiny_model(1))).sync(version=7)
    assert not result.checksum_ok
    assert result.mismatched == [f"model.layers.{i}.post_attention_layernorm.weight" for i in range(2)]


def tied_model(seed: int, dtype: torch.dtype = torch.float32) -> CausalLM:
    from dataclasses import replace

    torch.manual_seed(seed)
    model = CausalLM(replace(tiny_model().args, tie_word_embeddings=True))
    model.init_weights()
    return model.to(dtype)


def test_a_tied_head_in_the_stream_is_checked_against_the_shared_embedding() -> None:
    """A trainer streaming its state dict of a tied model sends `lm_head.weight` too, which the engine skips
    (its head is its embedding): that must verify, and an lm_head that differs from the embedding it would
    share must not."""
    trainer = tied_model(0)
    engine = LoadingEngine(tied_model(1))
    stream = lambda: list(trainer.state_dict().items())  # noqa: E731
    assert "lm_head.weight" in dict(stream())
    result = InProcessWeightSync(Streaming(stream), engine, bucket_bytes=1000).sync(version=1)
    assert result.checksum_ok, result.mismatched
    assert torch.equal(engine.model.lm_head.weight, trainer.model.embed_tokens.weight)

    untied = [(n, t + 1.0 if n == "lm_head.weight" else t) for n, t in stream()]
    result = InProcessWeightSync(Streaming(lambda: untied), LoadingEngine(tied_model(1))).sync(version=2)
    assert result.mismatched == ["lm_head.weight"]


def test_a_sync_across_dtypes_and_buckets_agrees_bit_for_bit() -> None:
    """float32 trainer -> bf16 engine and back, with buckets smaller than one tensor (each goes alone)."""
    for trainer_dtype, engine_dtype in ((torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)):
        trainer = tiny_model(0).to(trainer_dtype)
        engine = LoadingEngine(tiny_model(1).to(engine_dtype))
        sync = InProcessWeightSync(trainer, engine, bucket_bytes=64)
        result = sync.sync(version=1)
        assert result.checksum_ok, result.mismatched
        for (name, a), b in zip(trainer.named_parameters(), engine.model.parameters()):
            assert b.dtype == engine_dtype and torch.equal(a.to(engine_dtype), b), name
        # the trainer's own-dtype fingerprints, for the replicas
        assert result.fingerprints == fingerprints(trainer.named_parameters())
        assert result.bytes == sum(p.numel() * engine_dtype.itemsize for p in trainer.parameters())


def test_a_tensor_the_engine_has_no_place_for_fails_with_the_engines_error() -> None:
    import pytest

    trainer = tiny_model(0)
    extra = [(n, p.detach()) for n, p in trainer.named_parameters()]
    extra.append(("model.layers.0.mlp.experts.9.down_proj.weight", torch.zeros(16, 8)))  # 4 experts only
    with pytest.raises(KeyError, match="has no place in this qwen3_moe model"):
        InProcessWeightSync(Streaming(lambda: extra), LoadingEngine(tiny_model(1))).sync(version=1)
