"""Device memory whose address outlives its backing: the KV pool's storage under colocated training.

The pool is released while the trainer updates (rollout.release_kv_during_train). Freed through torch, it
would come back at another address, and every CUDA graph captured over it would have to be captured again
(2.3-4 s a step on Qwen3-4B). Here the address range is reserved once through the CUDA driver's virtual
memory management: `unmap()` gives the physical memory back to the device, `map()` backs the same
addresses with new memory, and the graphs replay as captured. SGLang's torch_memory_saver and vLLM's sleep
mode do the same by intercepting cudaMalloc; the pool is one allocation of ours, so mapping it directly is
enough. The driver is reached through ctypes: libcuda comes with the driver, no package is needed.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import math
from collections.abc import Iterator
from typing import Any

import torch

_SUCCESS = 0
_OUT_OF_MEMORY = 2
_ALLOCATION_TYPE_PINNED = 1
_LOCATION_TYPE_DEVICE = 1
_GRANULARITY_RECOMMENDED = 1
_ACCESS_READ_WRITE = 3
_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT = 102
_ALIGNMENT = 256  # of the tensors carved out of a region (what cudaMalloc guarantees)


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocationFlags(ctypes.Structure):
    _fields_ = [
        ("compression_type", ctypes.c_ubyte),
        ("gpu_direct_rdma_capable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    ]


class _AllocationProp(ctypes.Structure):  # CUmemAllocationProp
    _fields_ = [
        ("type", ctypes.c_int),
        ("requested_handle_types", ctypes.c_int),
        ("location", _Location),
        ("win32_handle_meta_data", ctypes.c_void_p),
        ("alloc_flags", _AllocationFlags),
    ]


class _AccessDesc(ctypes.Structure):  # CUmemAccessDesc
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


_u64, _size, _int = ctypes.c_uint64, ctypes.c_size_t, ctypes.c_int
_SIGNATURES: dict[str, list[Any]] = {  # cuda.h: CUdeviceptr and handles are 64-bit, CUdevice and enums int
    "cuGetErrorName": [_int, ctypes.POINTER(ctypes.c_char_p)],
    "cuDeviceGet": [ctypes.POINTER(_int), _int],
    "cuDeviceGetAttribute": [ctypes.POINTER(_int), _int, _int],
    "cuMemGetAllocationGranularity": [ctypes.POINTER(_size), ctypes.POINTER(_AllocationProp), _int],
    "cuMemAddressReserve": [ctypes.POINTER(_u64), _size, _size, _u64, _u64],
    "cuMemAddressFree": [_u64, _size],
    "cuMemCreate": [ctypes.POINTER(_u64), _size, ctypes.POINTER(_AllocationProp), _u64],
    "cuMemMap": [_u64, _size, _size, _u64, _u64],
    "cuMemSetAccess": [_u64, _size, ctypes.POINTER(_AccessDesc), _size],
    "cuMemUnmap": [_u64, _size],
    "cuMemRelease": [_u64],
}


@functools.cache
def _driver() -> ctypes.CDLL:
    driver = ctypes.CDLL("libcuda.so.1")
    for name, argtypes in _SIGNATURES.items():
        fn = getattr(driver, name)
        fn.argtypes, fn.restype = argtypes, _int
    return driver


_orphans: list[tuple[torch.device, int, int, int | None]] = []
"""(device, address, bytes, physical handle) of regions collected while a stream was capturing a CUDA graph,
where the synchronisation their freeing needs is not allowed; freed by `free_orphans()`."""


def free_orphans() -> None:
    """Free the regions garbage-collected during a graph capture (called before sizing a new pool)."""
    while _orphans and not torch.cuda.is_current_stream_capturing():
        _free(*_orphans.pop())


@contextlib.contextmanager
def _bound(device: torch.device) -> Iterator[None]:
    """`device`'s primary context current on this thread (the driver calls act on it), its work done."""
    with torch.cuda.device(device):
        torch.cuda.synchronize()  # a runtime call binds the context; it also waits for the region's users
        yield


def _free(device: torch.device, address: int, nbytes: int, handle: int | None) -> None:
    driver = _driver()
    with _bound(device):
        if handle is not None:
            _check(driver.cuMemUnmap(address, nbytes), "cuMemUnmap")
            _check(driver.cuMemRelease(handle), "cuMemRelease")
        _check(driver.cuMemAddressFree(address, nbytes), "cuMemAddressFree")


def _check(result: int, call: str) -> None:
    if result == _SUCCESS:
        return
    name = ctypes.c_char_p()
    _driver().cuGetErrorName(result, ctypes.byref(name))
    what = name.value.decode() if name.value else f"error {result}"
    if result == _OUT_OF_MEMORY:
        raise torch.cuda.OutOfMemoryError(f"{call}: {what} (the device has no memory left for the KV pool)")
    raise RuntimeError(f"CUDA driver call {call} failed: {what}")


def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


def _ordinal(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def supported(device: torch.device) -> bool:
    """Whether `device` is a CUDA device whose driver maps memory at reserved addresses."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    try:
        driver = _driver()
    except OSError:
        return False
    handle, flag = ctypes.c_int(), ctypes.c_int()
    if driver.cuDeviceGet(ctypes.byref(handle), _ordinal(device)) != _SUCCESS:
        return False
    ok = driver.cuDeviceGetAttribute(ctypes.byref(flag), _ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT, handle.value)
    return ok == _SUCCESS and flag.value == 1


class _Span:
    """`__cuda_array_interface__` of bytes of a region: torch's tensor keeps this object, and with it the
    region, alive."""

    def __init__(self, region: VirtualRegion, offset: int, nbytes: int) -> None:
        self.region = region
        self.__cuda_array_interface__: dict[str, Any] = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (region.address + offset, False),
            "version": 2,
        }


class VirtualRegion:
    """`nbytes` of device memory at an address fixed for the region's life. Built mapped; `unmap()` frees the
    memory (nothing may touch the region until `map()`), `map()` backs the same addresses again, contents
    undefined."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        if not supported(device):
            raise RuntimeError(
                f"{device} has no CUDA virtual memory management (driver too old, or not a CUDA device); "
                "set rollout.kv_virtual_memory=off"
            )
        free_orphans()
        self.device = torch.device("cuda", _ordinal(device))
        self._prop = _AllocationProp()
        self._prop.type = _ALLOCATION_TYPE_PINNED
        self._prop.location = _Location(_LOCATION_TYPE_DEVICE, self.device.index)
        self._access = _AccessDesc(_Location(_LOCATION_TYPE_DEVICE, self.device.index), _ACCESS_READ_WRITE)
        granularity, address = ctypes.c_size_t(), ctypes.c_uint64()
        with _bound(self.device):
            _check(
                _driver().cuMemGetAllocationGranularity(
                    ctypes.byref(granularity), ctypes.byref(self._prop), _GRANULARITY_RECOMMENDED
                ),
                "cuMemGetAllocationGranularity",
            )
            self.nbytes = -(-max(1, nbytes) // granularity.value) * granularity.value
            _check(
                _driver().cuMemAddressReserve(ctypes.byref(address), self.nbytes, 0, 0, 0),
                "cuMemAddressReserve",
            )
        self.address = address.value
        self._handle: int | None = None
        self._carved = 0
        self.map()

    @property
    def mapped(self) -> bool:
        return self._handle is not None

    def map(self) -> None:
        if self.mapped:
            return
        free_orphans()
        driver, handle = _driver(), ctypes.c_uint64()
        with _bound(self.device):
            _check(
                driver.cuMemCreate(ctypes.byref(handle), self.nbytes, ctypes.byref(self._prop), 0),
                "cuMemCreate",
            )
            try:
                _check(driver.cuMemMap(self.address, self.nbytes, 0, handle.value, 0), "cuMemMap")
                try:
                    _check(
                        driver.cuMemSetAccess(self.address, self.nbytes, ctypes.byref(self._access), 1),
                        "cuMemSetAccess",
                    )
                except BaseException:
                    driver.cuMemUnmap(self.address, self.nbytes)
                    raise
            except BaseException:
                driver.cuMemRelease(handle.value)
                raise
        self._handle = handle.value

    def unmap(self) -> None:
        if self._handle is None:
            return
        driver, handle = _driver(), self._handle
        with _bound(self.device):
            _check(driver.cuMemUnmap(self.address, self.nbytes), "cuMemUnmap")
            self._handle = None  # unmapped: whatever happens to the handle, map() must map again
            _check(driver.cuMemRelease(handle), "cuMemRelease")

    def carve(self, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """The next unused bytes of the region as a tensor of `shape` (256-byte aligned)."""
        nbytes = _nbytes(dtype, shape)
        offset = -(-self._carved // _ALIGNMENT) * _ALIGNMENT
        if offset + nbytes > self.nbytes:
            raise ValueError(f"region of {self.nbytes} bytes: no room for {nbytes} more at offset {offset}")
        self._carved = offset + nbytes
        raw = torch.as_tensor(_Span(self, offset, nbytes), device=self.device)
        if raw.data_ptr() != self.address + offset or raw.device != self.device:  # a silent copy elsewhere
            raise RuntimeError(f"torch did not take the region's memory as a tensor on {self.device}")
        return raw.view(dtype).view(shape)

    def __del__(self) -> None:
        address = getattr(self, "address", None)
        if address is None:
            return
        try:
            if torch.cuda.is_current_stream_capturing():  # no synchronisation allowed now
                _orphans.append((self.device, address, self.nbytes, self._handle))
            else:
                _free(self.device, address, self.nbytes, self._handle)
        except Exception:  # interpreter shutdown: the driver frees everything with the context
            pass

    @staticmethod
    def bytes_for(shapes: list[tuple[torch.dtype, tuple[int, ...]]]) -> int:
        """Bytes a region needs to carve tensors of these dtypes and shapes, in this order."""
        end = 0
        for dtype, shape in shapes:
            end = -(-end // _ALIGNMENT) * _ALIGNMENT + _nbytes(dtype, shape)
        return end
