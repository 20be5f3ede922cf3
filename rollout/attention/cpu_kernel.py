"""The CPU decode-attention kernel (`cpu_kernel.c`): built with the system C compiler at first use, called
through ctypes.

At the decode shapes of a small model the CPU flash-attention kernel costs about a microsecond per (row,
head) pair: its tiles are a couple of queries by a head dimension of 16, and the cascade over a group's
shared prefix takes two of its calls and a merge per layer. On the `tiny` bench that was a third of a decode
step. This kernel attends every decode row over its group's prefix and its own suffix in one call, with one
softmax, reading keys stored transposed ([dim][positions], as `DecodeStaging` keeps them for it) so that the
scores vectorize over positions.

The library is built once per source, flags and CPU into `~/.cache/miles/kernels` (`MILES_KERNEL_CACHE`
overrides the folder, `CC` the compiler) and renamed into place, so a half-written build is never loaded;
where that folder cannot be written, each process builds its own in a private temporary folder.
Where the build or a call fails (no compiler, say), the first failure switches the kernel off with one
warning and the CPU flash-attention calls run instead; `MILES_CPU_ATTENTION_KERNEL=0` switches it off from
the start.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from miles.models import fused

log = logging.getLogger(__name__)
kernel = fused.KernelSwitch("CPU decode-attention kernel", "using the CPU flash-attention calls", log)
kernel.on = os.environ.get("MILES_CPU_ATTENTION_KERNEL", "1") != "0"

BLOCK = 16
"""Positions the kernel scores together: key capacities must be multiples of it (`BLOCK` in the C source)."""
QUERIES_PER_KV_HEAD = (1, 2, 4, 8)
HEAD_DIMS = (16, 32, 64, 128)
"""The shapes the C source has code for."""

_SOURCE = Path(__file__).with_name("cpu_kernel.c")
_FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fopenmp-simd", "-fPIC", "-shared")
_P, _I64, _I32, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_float
_ARGTYPES = (
    [_P, _I64, _I64]  # q, its row and head strides
    + [_P, _P, _I64, _I64, _I64, _I64, _P, _P]  # prefix keys, values, their strides, lengths, row groups
    + [_P, _P, _I64, _I64, _I64, _I64, _P]  # suffix keys, values, their strides, lengths
    + [_P, _P, _I64, _I64]  # out, scratch, prefix and suffix capacity
    + [_I32, _I32, _I32, _I32, _F32]  # rows, kv heads, query heads per kv head, head dim, scale
)
_function: Any = None


def applies(dtype: torch.dtype, device: torch.device, q_per_kv: int, head_dim: int) -> bool:
    """Whether the kernel has code for these decodes (float32 on CPU)."""
    return (
        device.type == "cpu"
        and dtype == torch.float32
        and q_per_kv in QUERIES_PER_KV_HEAD
        and head_dim in HEAD_DIMS
    )


def usable() -> bool:
    """Whether a step should run the kernel now: it is on, and torch runs on one thread. The kernel is
    single-threaded; with more intra-op threads the flash-attention calls spread their rows and heads over
    them."""
    return kernel.on and torch.get_num_threads() == 1


def _cpu_key() -> bytes:
    """What the library depends on besides its source and flags: the instruction set (-march=native)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        flags = next(line for line in lines if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = platform.processor()
    return f"{platform.machine()} {flags}".encode()


def _build(source: Path, out: Path) -> None:
    """Compile `source` into the shared library `out`, built aside and renamed: never half-written."""
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        built = Path(tmp) / out.name
        compiler = os.environ.get("CC", "cc")
        result = subprocess.run(
            [compiler, *_FLAGS, "-o", str(built), str(source)], capture_output=True, text=True, timeout=300
        )
        if result.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {result.stderr.strip()[-500:]}")
        os.replace(built, out)


def library_name() -> str:
    """The built library's file name: one per source, flags and CPU."""
    key = hashlib.sha256(_SOURCE.read_bytes() + " ".join(_FLAGS).encode() + _cpu_key()).hexdigest()[:16]
    return f"cpu_attention-{key}.so"


def library_cache() -> Path:
    return Path(os.environ.get("MILES_KERNEL_CACHE", Path.home() / ".cache" / "miles" / "kernels"))


def _load() -> Any:
    global _function
    if _function is not None:
        return _function
    cache = library_cache()
    path = cache / library_name()
    if not path.exists():
        try:
            cache.mkdir(parents=True, exist_ok=True)
            _build(_SOURCE, path)
        except OSError:
            # A cache that cannot be written (a read-only home, say): build for this process in a private
            # folder of its own, never in a shared one where another user could have put a library under the
            # expected name.
            path = Path(tempfile.mkdtemp(prefix="miles-kernels-")) / path.name
            _build(_SOURCE, path)
    function = ctypes.CDLL(str(path)).cascade_decode
    function.restype = ctypes.c_int
    function.argtypes = _ARGTYPES
    _function = function
    return function


def whole_blocks(n: int) -> int:
    """`n` positions rounded up to whole blocks of `BLOCK`: what the kernel reads of a key row."""
    return -(-n // BLOCK) * BLOCK


def _longest(name: str, values: torch.Tensor, lowest: int = 0) -> int:
    """The largest of `values`, which the C code reads as a contiguous int32 CPU array of values >= `lowest`."""
    if (
        values.dtype != torch.int32
        or values.device.type != "cpu"
        or not values.is_contiguous()
        or values.dim() != 1
    ):
        raise ValueError(f"{name}: a contiguous 1-d int32 CPU tensor expected")
    if not values.numel():
        return 0
    if int(values.min()) < lowest:
        raise ValueError(f"{name}: values below {lowest}")
    return int(values.max())


@dataclass
class DecodePlan:
    """One decode step's fixed arguments to the kernel, checked once: each row's suffix length and, where
    rows share prefixes, each row's group and each group's prefix length. `attend` then runs a layer."""

    suffix_lengths: torch.Tensor
    """[rows] int32."""
    prefix_lengths: torch.Tensor | None = None
    """[groups] int32, or None when no row has a shared prefix."""
    row_group: torch.Tensor | None = None
    """[rows] int32: each row's group, -1 for a row without one."""

    def __post_init__(self) -> None:
        self.layouts: dict[str, tuple[Any, ...]] = {}
        """The layouts checked already, by name (every layer of a step hands over the same)."""
        self.rows = self.suffix_lengths.numel()
        self.longest_suffix = _longest("suffix lengths", self.suffix_lengths)
        self.longest_prefix = 0
        if self.prefix_lengths is not None:
            if self.row_group is None or self.row_group.numel() != self.rows:
                raise ValueError("prefix lengths need a group for every row")
            self.longest_prefix = _longest("prefix lengths", self.prefix_lengths)
            _longest("row groups", self.row_group, lowest=-1)
            if self.rows and int(self.row_group.max()) >= self.prefix_lengths.numel():
                raise ValueError("a row's group is out of range")

    def _checked(
        self, name: str, kv: tuple[torch.Tensor, torch.Tensor], count: int, heads: int, dim: int, longest: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys as [count, heads, dim, positions] with a row pitch of whole blocks, values [count, heads,
        positions, dim]) from the views [count, heads, positions, dim] that `DecodeStaging` hands out, or an error
        where the memory does not have the layout the kernel reads."""
        keys, values = kv[0].mT, kv[1]
        layout = (
            keys.shape,
            keys.stride(),
            values.shape,
            values.stride(),
            keys.dtype,
            values.dtype,
            keys.storage_offset(),
            keys.untyped_storage().nbytes(),
        )
        if self.layouts.get(name) == layout and keys.device.type == values.device.type == "cpu":
            return keys, values
        for t in (keys, values):
            if t.dtype != torch.float32 or t.device.type != "cpu" or t.dim() != 4 or t.stride(3) != 1:
                raise ValueError(f"{name}: float32 CPU tensors with contiguous last dimensions expected")
        if (
            keys.shape[:3] != (count, heads, dim)
            or values.shape[:2] != (count, heads)
            or values.shape[3] != dim
        ):
            raise ValueError(f"{name} keys {tuple(keys.shape)} / values {tuple(values.shape)} do not fit")
        if min(keys.shape[3], values.shape[2]) < longest or values.stride(2) != dim:
            raise ValueError(f"{name}: shorter than its lengths, or values not [positions][dim]")
        pitch = keys.stride(2)
        # The kernel scores whole blocks: a key row's pitch must hold the longest length's last block.
        if pitch % BLOCK or pitch < whole_blocks(longest) or keys.stride(1) < dim * pitch:
            raise ValueError(
                f"{name} keys: each dimension's positions must be padded to a multiple of {BLOCK}"
            )
        # The last key row's last block, read in whole, must lie inside the keys' memory.
        end = keys.storage_offset() + (count - 1) * keys.stride(0) + (heads - 1) * keys.stride(1)
        end += (dim - 1) * pitch + whole_blocks(longest)
        if count and end * keys.element_size() > keys.untyped_storage().nbytes():
            raise ValueError(f"{name} keys: the padded positions past the longest length lie outside them")
        self.layouts[name] = layout
        return keys, values

    def attend(
        self,
        q: torch.Tensor,
        prefix: tuple[torch.Tensor, torch.Tensor] | None,
        suffix: tuple[torch.Tensor, torch.Tensor],
        scale: float,
    ) -> torch.Tensor | None:
        """Attention of the decode rows q [rows, Hq, D] over their group's prefix keys/values (each [groups,
        Hkv, P, D], the keys a transposed view, `DecodeStaging`'s layout) and their own suffix ([rows, Hkv, L,
        D], likewise). Returns [rows, Hkv, Hq / Hkv, D], or None once the kernel is off (the caller runs the
        flash-attention path)."""
        return kernel.run(self._attend, q, prefix, suffix, scale)

    def _attend(
        self,
        q: torch.Tensor,
        prefix: tuple[torch.Tensor, torch.Tensor] | None,
        suffix: tuple[torch.Tensor, torch.Tensor],
        scale: float,
    ) -> torch.Tensor:
        function = _load()
        rows, q_heads, dim = q.shape
        kv_heads = suffix[1].shape[1]
        q_per_kv = q_heads // kv_heads
        if (
            rows != self.rows
            or q.stride(2) != 1
            or q.dtype != torch.float32
            or q.device.type != "cpu"
            or q_heads % kv_heads
        ):
            raise ValueError(f"q {tuple(q.shape)} does not fit the plan's {self.rows} float32 rows")
        skt, sv = self._checked("suffix", suffix, rows, kv_heads, dim, self.longest_suffix)
        if (prefix is None) != (self.prefix_lengths is None):
            raise ValueError("the prefixes do not fit the plan")
        p_args: list[Any] = [None, None, 0, 0, 0, 0, None, None]
        pcap = 0
        if prefix is not None:
            assert self.prefix_lengths is not None and self.row_group is not None
            pkt, pv = self._checked(
                "prefix", prefix, self.prefix_lengths.numel(), kv_heads, dim, self.longest_prefix
            )
            pcap = pkt.stride(2)
            p_args = [pkt.data_ptr(), pv.data_ptr(), pkt.stride(0), pkt.stride(1), pv.stride(0), pv.stride(1)]
            p_args += [self.prefix_lengths.data_ptr(), self.row_group.data_ptr()]
        scap = skt.stride(2)
        out = torch.empty(rows, kv_heads, q_per_kv, dim, dtype=torch.float32)
        scratch = torch.empty(q_per_kv * (pcap + scap + BLOCK), dtype=torch.float32)
        status = function(
            q.data_ptr(),
            q.stride(0),
            q.stride(1),
            *p_args,
            skt.data_ptr(),
            sv.data_ptr(),
            skt.stride(0),
            skt.stride(1),
            sv.stride(0),
            sv.stride(1),
            self.suffix_lengths.data_ptr(),
            out.data_ptr(),
            scratch.data_ptr(),
            pcap,
            scap,
            rows,
            kv_heads,
            q_per_kv,
            dim,
            scale,
        )
        if status != 0:
            raise ValueError(f"no kernel for {q_per_kv} query heads per KV head of dim {dim}")
        return out
