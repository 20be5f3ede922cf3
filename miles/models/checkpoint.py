"""Hugging Face checkpoint IO: config.json + (sharded) safetensors + index json. Never pickle.

On disk, tensors keep Hugging Face's names; in memory, matrices applied to the same input are stacked:
`self_attn.q/k/v_proj` -> `self_attn.qkv_proj`, dense `mlp.gate/up_proj` -> `mlp.gate_up_proj`, and MoE
experts (`mlp.experts.E.gate_proj.weight`, ...) -> `mlp.experts.gate_up_proj`, `mlp.experts.down_proj`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from miles.models.args import ModelArgs
from miles.models.model import CausalLM

_EXPERT_KEY = re.compile(
    r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$"
)
_STACKED_KEY = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")
_ROW_PARTS = {"self_attn": ("q_proj", "k_proj", "v_proj"), "mlp": ("gate_proj", "up_proj")}
_ROW_STACKED = {"self_attn": "qkv_proj", "mlp": "gate_up_proj"}
_PART_KEY = re.compile(
    r"^(model\.layers\.\d+\.(self_attn|mlp))\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.(weight|bias)$"
)
_ROW_STACKED_KEY = re.compile(
    r"^(model\.layers\.\d+\.(self_attn|mlp))\.(qkv_proj|gate_up_proj)\.(weight|bias)$"
)
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "generation_config.json",
    "added_tokens.json",
)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {sorted(DTYPES)}")
    return DTYPES[dtype]


class CheckpointFileError(ValueError):
    """A checkpoint file that cannot be read (truncated, missing, not JSON); the message names it and what to do."""


_RECOPY = "copy it again from where the checkpoint came from (an interrupted download or copy leaves it so)"


def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:  # also a JSON error (a ValueError)
            problem = (
                f"not valid JSON ({e})" if isinstance(e, ValueError) else "without a 'weight_map' object"
            )
            raise CheckpointFileError(f"{index} is {problem}; {_RECOPY}") from e
        files = [path / name for name in names]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointFileError(
                f"{path} lacks {missing[:5]} ({len(missing)} of the {len(files)} shards that "
                f"model.safetensors.index.json lists are missing); {_RECOPY}"
            )
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        if any(path.glob("*.bin")) or any(path.glob("*.pt")):
            raise FileNotFoundError(
                f"{path} holds only pickle weights (*.bin / *.pt); miles reads safetensors only. Convert it once "
                "with transformers (`model.save_pretrained(dir, safe_serialization=True)`)."
            )
        raise FileNotFoundError(f"no *.safetensors in {path}; expected a Hugging Face checkpoint folder")
    return files


def iter_hf_tensors(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every tensor of a checkpoint folder; a damaged file is a CheckpointFileError naming
    the file (and the tensor), not the safetensors library's bare message."""
    for file in _safetensors_files(Path(path)):
        try:
            handle = safe_open(str(file), framework="pt")
        except (SafetensorError, OSError) as e:  # a header cut short, or not safetensors at all
            raise CheckpointFileError(
                f"{file} is not a complete safetensors file ({e}; {file.stat().st_size} bytes): it is probably "
                f"truncated; {_RECOPY}"
            ) from e
        with handle as f:
            for key in list(f.keys()):
                try:
                    tensor = f.get_tensor(key)
                except (SafetensorError, OSError) as e:  # its data past the end of the file
                    raise CheckpointFileError(
                        f"{file}: tensor {key!r} cannot be read ({e}); the file is probably truncated; {_RECOPY}"
                    ) from e
                yield key, tensor


def _row_sizes(block: str, args: ModelArgs) -> list[int]:
    """Rows of each part of a stacked matrix, in `_ROW_PARTS` order."""
    if block == "self_attn":
        q_size = args.num_attention_heads * args.head_dim  # type: ignore[operator]
        kv_size = args.num_key_value_heads * args.head_dim  # type: ignore[operator]
        return [q_size, kv_size, kv_size]
    return [args.intermediate_size] * 2


def model_slot(key: str, args: ModelArgs) -> tuple[str, tuple[int | slice, ...]] | None:
    """Where a tensor named as on disk (Hugging Face) or as in the model goes: (parameter name, index into
    it). A part of a stacked matrix (a layer's q_proj, an expert's up_proj) is a slice of its rows, so parts
    load one by one, in any order, and on their own. None for tensors the model does not keep."""
    if key.endswith("rotary_emb.inv_freq"):
        return None
    part = _PART_KEY.match(key)
    if part is not None:
        prefix, block, name, kind = part.groups()
        sizes = _row_sizes(block, args)
        i = _ROW_PARTS[block].index(name)
        return f"{prefix}.{_ROW_STACKED[block]}.{kind}", (slice(sum(sizes[:i]), sum(sizes[: i + 1])),)
    expert = _EXPERT_KEY.match(key)
    if expert is not None:
        prefix, e, proj = expert.group(1), int(expert.group(2)), expert.group(3)
        size = args.moe_intermediate_size
        if proj == "down_proj":
            return f"{prefix}.down_proj", (e,)
        rows = slice(0, size) if proj == "gate_proj" else slice(size, 2 * size)
        return f"{prefix}.gate_up_proj", (e, rows)
    # The model's own names (transformers 5 may also write experts stacked) go where they say.
    return key, ()


def copy_named_tensors(
    model: CausalLM, tensors: Iterable[tuple[str, torch.Tensor]], source: str
) -> set[tuple[str, str]]:
    """Copy each tensor into its place in the model (`model_slot`); returns the places written, as
    (parameter name, index) pairs. With tied embeddings an `lm_head.weight` is skipped, as transformers
    does: the embedding is the one matrix, whatever order the two arrive in."""
    args = model.args
    params = dict(model.named_parameters())
    written: set[tuple[str, str]] = set()
    with torch.no_grad():
        for key, tensor in tensors:
            slot = model_slot(key, args)
            if slot is None or (key == "lm_head.weight" and args.tie_word_embeddings):
                continue
            name, index = slot
            target = params.get(name)
            if target is None or (index and isinstance(index[0], int) and index[0] >= target.shape[0]):
                raise KeyError(
                    f"{source}: {key!r} has no place in this {args.model_type} model ({args.num_hidden_layers} "
                    f"layers, {args.num_experts or 'no'} experts, biases: attention {args.attention_bias}, mlp "
                    f"{args.mlp_bias}). Names are Hugging Face's (q/k/v_proj, gate/up_proj, per-expert) or the "
                    "model's own (qkv_proj, gate_up_proj); check that config.json matches the weights"
                )
            place = target[index]
            if tuple(place.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"{source}: {key} has shape {tuple(tensor.shape)} but this model's place for it is "
                    f"{tuple(place.shape)}; check that config.json (heads, head_dim, intermediate sizes) matches "
                    "the weights"
                )
            place.copy_(tensor)
            written.add((name, repr(index)))
    return written


def internal_to_hf(state: dict[str, torch.Tensor], args: ModelArgs) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's state dict in on-disk names (tied lm_head left out, experts split)."""
    for key, tensor in state.items():
        if key == "lm_head.weight" and args.tie_word_embeddings:
            continue
        stacked = _ROW_STACKED_KEY.match(key)
        if stacked is not None:
            prefix, block, _, kind = stacked.groups()
            parts = tensor.split(_row_sizes(block, args), dim=0)
            for name, part_tensor in zip(_ROW_PARTS[block], parts):
                yield f"{prefix}.{name}.{kind}", part_tensor
            continue
        match = _STACKED_KEY.match(key)
        if match is None:
            yield key, tensor
            continue
        prefix, which = match.groups()
        for expert in range(tensor.shape[0]):
            if which == "gate_up_proj":
                gate, up = tensor[expert].chunk(2, dim=0)
                yield f"{prefix}.{expert}.gate_proj.weight", gate
                yield f"{prefix}.{expert}.up_proj.weight", up
            else:
                yield f"{prefix}.{expert}.down_proj.weight", tensor[expert]


def load_state_into(
    model: CausalLM, tensors: Iterable[tuple[str, torch.Tensor]], source: str = "checkpoint"
) -> None:
    """Load a whole checkpoint (Hugging Face or model names); every row of every parameter must be given.
    `source` (the folder) is named in the errors."""
    args = model.args
    written = copy_named_tensors(model, tensors, source)
    missing: list[str] = []
    for name, param in model.named_parameters():
        if (name, "()") in written:
            continue
        # Not given whole: each of its Hugging Face parts must have been.
        for key, _ in internal_to_hf({name: param}, args):
            slot = model_slot(key, args)
            if slot is not None and (slot[0], repr(slot[1])) not in written:
                missing.append(key)
    if missing:
        raise ValueError(
            f"{source} is missing {len(missing)} tensors, e.g. {missing[:5]}; check that config.json (layers, "
            "experts) matches the weights, or copy the missing shards"
        )


def from_pretrained(
    path: str | Path, dtype: str | torch.dtype | None = "float32", device: str | torch.device = "cpu"
) -> CausalLM:
    """Load an HF-format checkpoint folder (Qwen3, Qwen3-MoE or Llama) into our `CausalLM`."""
    path = Path(path)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"{path} has no config.json; pass a Hugging Face checkpoint folder")
    args = ModelArgs.from_json(path / "config.json")
    torch_dtype = resolve_dtype(dtype) or torch.float32
    with torch.device("meta"):
        model = CausalLM(args)
    model = model.to_empty(device=device)
    if args.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    load_state_into(model, iter_hf_tensors(path), str(path))
    return model.to(dtype=torch_dtype)  # RoPE frequencies stay float32 (see layers.RotaryEmbedding)


def save_pretrained(
    model: CausalLM,
    path: str | Path,
    max_shard_bytes: int = 2 * 1024**3,
    tokenizer_dir: str | Path | None = None,
    tokenizer: object | None = None,
    write_extra: Callable[[Path], None] | None = None,
) -> Path:
    """Write config.json + safetensors (sharded with an index past `max_shard_bytes`) atomically.

    The folder is assembled next to its destination and renamed into place, so a crash never leaves a
    half-written checkpoint under the final name; its files are fsynced before the rename and the parent
    folder after it, so a power loss cannot leave the new name on empty files either. `write_extra(folder)`
    adds files of its own (a run's resume state) before the rename.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        state = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}
        tensors = [(k, v.contiguous()) for k, v in internal_to_hf(state, model.args)]
        shards: list[dict[str, torch.Tensor]] = [{}]
        size = 0
        for key, tensor in tensors:
            nbytes = tensor.numel() * tensor.element_size()
            if shards[-1] and size + nbytes > max_shard_bytes:
                shards.append({})
                size = 0
            shards[-1][key] = tensor
            size += nbytes
        if len(shards) == 1:
            save_file(shards[0], str(tmp / "model.safetensors"), metadata={"format": "pt"})
        else:
            weight_map = {}
            for i, shard in enumerate(shards):
                name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                save_file(shard, str(tmp / name), metadata={"format": "pt"})
                weight_map.update({key: name for key in shard})
            total = sum(t.numel() * t.element_size() for _, t in tensors)
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        config = model.args.to_hf_dict()
        config["torch_dtype"] = str(model.dtype).removeprefix("torch.")
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        if tokenizer_dir is not None:
            copy_tokenizer_files(tokenizer_dir, tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
        if write_extra is not None:
            write_extra(tmp)
        _apply_umask(tmp)
        # Data and folder entries on disk before the rename publishes them (a rename is ordered against
        # neither on ext4/xfs), then the rename itself.
        _fsync_tree(tmp)
        if path.exists():
            old = path.with_name(f".{path.name}.old-{os.getpid()}")
            path.rename(old)
            tmp.rename(path)
            _fsync_dir(path.parent)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(path)
            _fsync_dir(path.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def _fsync_tree(folder: Path) -> None:
    """fsync every file under `folder`, then every folder (deepest first), so their entries are durable."""
    folders = [folder]
    for path in folder.rglob("*"):
        if path.is_dir():
            folders.append(path)
        elif path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    for sub in reversed(folders):
        _fsync_dir(sub)


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # no directory handles (Windows): nothing to sync
        return
    try:
        os.fsync(fd)
    except OSError:  # some filesystems (network, FUSE) cannot fsync a directory; their files are synced
        pass
    finally:
        os.close(fd)


def _apply_umask(folder: Path) -> None:
    """mkdtemp makes the folder 0700 and safetensors writes 0600 files; give them the modes a plain mkdir /
    open would (as transformers' own checkpoints have), so other users and services can read them."""
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for path in folder.rglob("*"):  # subfolders too (a run's resume/ state): searchable, like mkdir's
        path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)


def copy_tokenizer_files(src: str | Path, dst: str | Path) -> None:
    for name in TOKENIZER_FILES:
        file = Path(src) / name
        if file.exists():
            shutil.copy2(file, Path(dst) / name)
