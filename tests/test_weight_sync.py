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
