"""Checkpoint IO: sharded safetensors + index, atomic writes, pickle refusal, random init on a device."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

import miles.models.checkpoint as checkpoint
from miles.models import CausalLM, from_pretrained, save_pretrained
from miles.models.presets import build_random_model, preset_args


def tiny(arch: str = "qwen3_moe", seed: int = 0, dtype: str = "float32") -> CausalLM:
    return build_random_model(preset_args(arch, "tiny"), dtype=dtype, seed=seed, std=0.2)


def state_equal(a: CausalLM, b: CausalLM) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def ids_for(model: CausalLM) -> torch.Tensor:
    return torch.randint(0, model.args.vocab_size, (2, 13), generator=torch.Generator().manual_seed(0))


@torch.no_grad()
def test_sharded_save_index_round_trip(tmp_path: Path) -> None:
    model = tiny()
    folder = save_pretrained(model, tmp_path / "ckpt", max_shard_bytes=60_000)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shards = sorted(folder.glob("*.safetensors"))
    assert len(shards) > 2 and not (folder / "model.safetensors").exists()
    assert sorted(set(index["weight_map"].values())) == [s.name for s in shards]
    stored: dict[str, str] = {}
    total = 0
    for shard in shards:
        with safe_open(str(shard), framework="pt") as f:
            for key in f.keys():
                stored[key] = shard.name
                tensor = f.get_tensor(key)
                total += tensor.numel() * tensor.element_size()
    assert stored == index["weight_map"]
    assert index["metadata"]["total_size"] == total
    # On disk: Hugging Face's per-expert names, not our stacked ones.
    assert "model.layers.0.mlp.experts.3.down_proj.weight" in stored
    assert not any(key.endswith("gate_up_proj") for key in stored)
    loaded = from_pretrained(folder)
    assert state_equal(loaded, model)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ids = ids_for(model)
    expected = hf(ids).logits
    assert float((model(ids) - expected).abs().max() / expected.abs().max()) <= 1e-5


@torch.no_grad()
@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_stacked_projections_keep_hf_names_on_disk(tmp_path: Path, arch: str) -> None:
    """q/k/v and gate/up are one matrix each in memory, Hugging Face's separate tensors (biases too) on disk."""
    args = preset_args(arch, "tiny")
    args.attention_bias = True
    if arch == "llama":
        args.mlp_bias = True
    model = build_random_model(args, dtype="float32", seed=3, std=0.2)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, 0.2)  # init zeroes them; a bias in the wrong rows must show in the logits
    folder = save_pretrained(model, tmp_path / "ckpt")
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        stored = set(f.keys())
    for name in ("q_proj", "k_proj", "v_proj"):
        assert f"model.layers.1.self_attn.{name}.bias" in stored
    assert "model.layers.1.mlp.up_proj.weight" in stored
    assert not any("qkv_proj" in key or "gate_up_proj" in key for key in stored)
    assert state_equal(from_pretrained(folder), model)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ids = ids_for(model)
    expected = hf(ids).logits
    assert float((model(ids) - expected).abs().max() / expected.abs().max()) <= 1e-5


def test_parts_of_stacked_matrices_load_on_their_own() -> None:
    """A weight update may carry any subset of parts (e.g. only q_proj and v_proj, or one expert's up_proj);
    a checkpoint load must cover every row."""
    from miles.rollout.weights import load_weights

    model, new = tiny("qwen3_moe", seed=0), tiny("qwen3_moe", seed=1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    hf_new = dict(checkpoint.internal_to_hf(new.state_dict(), new.args))
    attn, experts = "model.layers.0.self_attn", "model.layers.1.mlp.experts"
    load_weights(model, [(f"{attn}.v_proj.weight", hf_new[f"{attn}.v_proj.weight"])])
    load_weights(model, {f"{experts}.2.up_proj.weight": hf_new[f"{experts}.2.up_proj.weight"]})
    a = model.model.layers[0].self_attn
    qkv, qkv_before = a.qkv_proj.weight, before[f"{attn}.qkv_proj.weight"]
    assert torch.equal(qkv[: a.q_size + a.kv_size], qkv_before[: a.q_size + a.kv_size])
    assert torch.equal(qkv[a.q_size + a.kv_size :], hf_new[f"{attn}.v_proj.weight"])
    size = model.args.moe_intermediate_size
    gate_up = model.model.layers[1].mlp.experts.gate_up_proj
    assert torch.equal(gate_up[2, size:], hf_new[f"{experts}.2.up_proj.weight"])
    assert torch.equal(gate_up[2, :size], before[f"{experts}.gate_up_proj"][2, :size])
    assert torch.equal(gate_up[1], before[f"{experts}.gate_up_proj"][1])
    changed = [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]
    assert sorted(changed) == [f"{attn}.qkv_proj.weight", f"{experts}.gate_up_proj"]
    with pytest.raises(ValueError, match="shape"):
        load_weights(model, {f"{attn}.k_proj.weight": hf_new[f"{attn}.q_proj.weight"]})
    with pytest.raises(KeyError, match="has no place"):
        load_weights(model, {f"{experts}.999.up_proj.weight": hf_new[f"{experts}.2.up_proj.weight"]})

    # A checkpoint load names the Hugging Face tensors it lacks; another spelling of a present one
    # (expert "02" for expert 2) does not stand in for a missing one.
    incomplete = {
        k: v for k, v in hf_new.items() if k not in (f"{attn}.k_proj.weight", f"{experts}.3.gate_proj.weight")
    }
    incomplete[f"{experts}.02.up_proj.weight"] = hf_new[f"{experts}.2.up_proj.weight"]
    with pytest.raises(ValueError, match=r"missing 2 tensors") as err:
        checkpoint.load_state_into(tiny("qwen3_moe"), iter(incomplete.items()))
    assert f"{attn}.k_proj.weight" in str(err.value) and f"{experts}.3.gate_proj.weight" in str(err.value)
    fresh = tiny("qwen3_moe", seed=5)
    checkpoint.load_state_into(fresh, iter(hf_new.items()))
    assert state_equal(fresh, new)


def test_tied_lm_head_in_a_checkpoint_is_ignored() -> None:
    """With tied embeddings the embedding is the one matrix (as in transformers), whatever order a stray
    lm_head.weight arrives in."""
    model = tiny("qwen3", seed=0)
    model.args.tie_word_embeddings = True
    fresh = build_random_model(model.args, dtype="float32", seed=1)
    state = dict(checkpoint.internal_to_hf(model.state_dict(), model.args))
    stray = {"lm_head.weight": torch.randn_like(state["model.embed_tokens.weight"])}
    checkpoint.load_state_into(fresh, iter([*state.items(), *stray.items()]))
    assert torch.equal(fresh.model.embed_tokens.weight, state["model.embed_tokens.weight"])
    assert fresh.lm_head.weight is fresh.model.embed_tokens.weight


def _fail_on_second_shard(monkeypatch: pytest.MonkeyPatch) -> None:
    real_save_file = checkpoint.save_file
    calls = {"n": 0}

    def flaky_save_file(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError("disk full (simulated)")
        return real_save_file(*args, **kwargs)

    monkeypatch.setattr(checkpoint, "save_file", flaky_save_file)


def test_failed_save_leaves_no_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fail_on_second_shard(monkeypatch)
    with pytest.raises(OSError, match="simulated"):
        save_pretrained(tiny(), tmp_path / "ckpt", max_shard_bytes=60_000)
    assert list(tmp_path.iterdir()) == []  # neither the final name nor a temporary folder


def test_existing_checkpoint_replaced_only_when_new_one_is_complete(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    old, new = tiny(seed=1), tiny(seed=2)
    target = save_pretrained(old, tmp_path / "ckpt", max_shard_bytes=60_000)
    with monkeypatch.context() as patch:
        _fail_on_second_shard(patch)
        with pytest.raises(OSError, match="simulated"):
            save_pretrained(new, target, max_shard_bytes=60_000)
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]
    assert state_equal(from_pretrained(target), old)
    save_pretrained(new, target)  # now unsharded: stale shards of the old one must not linger
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]
    assert sorted(p.name for p in target.iterdir()) == ["config.json", "model.safetensors"]
    assert state_equal(from_pretrained(target), new)


def test_pickle_only_folder_gives_clear_error(tmp_path: Path) -> None:
    model = tiny("qwen3")
    folder = save_pretrained(model, tmp_path / "ckpt")
    (folder / "model.safetensors").unlink()
    torch.save(model.state_dict(), folder / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match=r"pickle.*safetensors only"):
        from_pretrained(folder)
    (folder / "pytorch_model.bin").unlink()
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors"):
        from_pretrained(folder)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        from_pretrained(tmp_path / "nowhere")


def test_tied_checkpoint_has_no_lm_head_and_stays_tied(tmp_path: Path) -> None:
    args = preset_args("qwen3", "tiny")
    args.tie_word_embeddings = True
    model = build_random_model(args, seed=3)
    folder = save_pretrained(model, tmp_path / "ckpt")
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        assert "lm_head.weight" not in set(f.keys())
    loaded = from_pretrained(folder)
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    assert state_equal(loaded, model)


def test_build_random_model_on_device_dtype_and_seed() -> None:
    args = preset_args("qwen3_moe", "tiny")
    a = build_random_model(args, dtype="bfloat16", device="cpu", seed=7)
    b = build_random_model(args, dtype=torch.bfloat16, device=torch.device("cpu"), seed=7)
    c = build_random_model(args, dtype="bfloat16", seed=8)
    assert all(p.dtype == torch.bfloat16 for p in a.parameters())
    assert a.model.rotary_emb.inv_freq.dtype == torch.float32  # RoPE stays float32, as in transformers
    assert state_equal(a, b) and not state_equal(a, c)
    for name, param in a.named_parameters():
        if name.endswith("norm.weight"):
            assert torch.all(param == 1), name
        else:
            assert 0.01 < float(param.detach().float().std()) < 0.03, name  # normal(0, 0.02)
    with torch.no_grad():
        assert torch.isfinite(a(ids_for(a)).float()).all()


def test_checkpoint_permissions_follow_umask(tmp_path: Path) -> None:
    """Modes as mkdir / open would give them, subfolders included (a run's resume/ state, which safetensors
    writes 0600): root's CI reads any mode, so the modes themselves are checked."""

    def extra(folder: Path) -> None:
        (folder / "resume").mkdir()
        (folder / "resume" / "state.bin").write_bytes(b"x")
        (folder / "resume" / "state.bin").chmod(0o600)

    umask = os.umask(0o022)
    try:
        folder = save_pretrained(tiny("qwen3"), tmp_path / "ckpt", write_extra=extra)
    finally:
        os.umask(umask)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o755
    files = [p for p in folder.rglob("*") if p.is_file()]
    assert {stat.S_IMODE(f.stat().st_mode) for f in files} == {0o644} and len(files) > 2
    assert stat.S_IMODE((folder / "resume").stat().st_mode) == 0o755


def test_unsupported_config_fields_are_refused(tmp_path: Path) -> None:
    folder = save_pretrained(tiny("qwen3"), tmp_path / "ckpt")
    config = json.loads((folder / "config.json").read_text())
    for field, value, message in [
        ("use_sliding_window", True, "use_sliding_window"),
        ("hidden_act", "gelu", "hidden_act 'gelu'"),
        (
            "rope_parameters",
            {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 4.0},
            "'dynamic' is not supported",
        ),
        ("model_type", "gpt2", "model_type 'gpt2' is not supported"),
    ]:
        (folder / "config.json").write_text(json.dumps({**config, field: value}))
        with pytest.raises(ValueError, match=message):
            from_pretrained(folder)
