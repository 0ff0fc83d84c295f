"""gpupool.Pool: a pool of libgpupool_c, its memory and its figures."""
import ctypes
import json
from dataclasses import dataclass, fields
from typing import Callable, Optional

from ._library import ALL_DEVICES, NO_LIMIT, SEGMENTS, CStats, Config, PRESSURE_CALLBACK, check, lib


def open_device(spec: Optional[str] = None) -> int:
    """A device id: "cuda:N" (its ordinal), "sim:SIZE" (a new simulated device), "auto";
    None reads GPUPOOL_DEVICE."""
    device = ctypes.c_int(-1)
    check(lib().gpupool_device_open(spec.encode() if spec is not None else None, ctypes.byref(device)))
    return device.value


def device_memory(device: int) -> tuple:
    """(free, total) bytes of the device."""
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    check(lib().gpupool_device_memory(device, ctypes.byref(free), ctypes.byref(total)))
    return free.value, total.value


@dataclass(frozen=True)
class Stats:
    """One device's figures (or the sums over devices): gpupool_stats of gpupool.h."""
    in_use_bytes: int
    requested_bytes: int
    cached_bytes: int
    reserved_bytes: int
    peak_in_use_bytes: int
    peak_reserved_bytes: int
    stranded_bytes: int
    allocations: int
    frees: int
    cache_hits: int
    device_allocations: int
    device_frees: int
    out_of_memory_errors: int
    live_allocations: int


def _stream_handle(stream) -> Optional[int]:
    """A cudaStream_t from an int, None, or a framework stream (torch / CuPy: .cuda_stream, .ptr)."""
    if stream is None or isinstance(stream, int):
        return stream or None
    for attribute in ("cuda_stream", "ptr"):
        if hasattr(stream, attribute):
            return getattr(stream, attribute) or None
    raise TypeError(f"not a stream: {stream!r} (expected an int handle, a torch or a CuPy stream)")


class Pool:
    """A caching pool of device memory. Pools are shared handles: the memory of a pool whose last
    handle is gone returns to the device when it is freed. `segments` is where large blocks
    come from: "device" segments (above 64 KiB), "virtual" segments (above 4 KiB; pages mapped as
    blocks touch them, given back from between live blocks) or "none" (docs/pool.md)."""

    def __init__(self, max_pool_size: Optional[int] = None, max_cached_bytes: Optional[int] = None,
                 initial_reservation: int = 0, caching: bool = True, critical_pressure: float = 0.9,
                 segments: str = "device", *, _handle: Optional[int] = None):
        self._observers = {}
        if _handle is not None:
            self._handle = _handle
            return
        config = Config()
        lib().gpupool_config_init(ctypes.byref(config))
        config.max_pool_size = NO_LIMIT if max_pool_size is None else max_pool_size
        config.max_cached_bytes = NO_LIMIT if max_cached_bytes is None else max_cached_bytes
        config.initial_reservation = initial_reservation
        config.caching = 1 if caching else 0
        config.critical_pressure = critical_pressure
        if segments not in SEGMENTS:
            raise ValueError(f"segments={segments!r}: expected one of {sorted(SEGMENTS)}")
        config.segments = SEGMENTS[segments]
        handle = ctypes.c_void_p()
        check(lib().gpupool_pool_create(ctypes.byref(config), ctypes.byref(handle)))
        self._handle = handle.value

    @classmethod
    def from_environment(cls) -> "Pool":
        """GPUPOOL_MEMORY_LIMIT, GPUPOOL_CACHE_LIMIT, GPUPOOL_POOL and GPUPOOL_SEGMENTS
        (docs/pool.md)."""
        handle = ctypes.c_void_p()
        check(lib().gpupool_pool_create_from_environment(ctypes.byref(handle)))
        return cls(_handle=handle.value)

    @classmethod
    def process(cls) -> "Pool":
        """The process pool: the one PyTorch's and CuPy's hooks allocate from."""
        handle = ctypes.c_void_p()
        check(lib().gpupool_process_pool(ctypes.byref(handle)))
        return cls(_handle=lib().gpupool_pool_retain(handle.value))

    def __del__(self):
        handle, self._handle = getattr(self, "_handle", None), None
        if handle:
            lib().gpupool_pool_release(handle)

    @property
    def handle(self) -> int:
        """The gpupool_pool* of the C ABI."""
        return self._handle

    # ---- memory ----
    def allocate(self, device: int, nbytes: int, stream=None) -> int:
        """A device pointer of nbytes (>= 1), ordered on `stream`."""
        ptr = ctypes.c_void_p()
        check(lib().gpupool_allocate(self._handle, device, nbytes, _stream_handle(stream), ctypes.byref(ptr)))
        return ptr.value

    def free(self, ptr: int, stream=None) -> None:
        """Frees ptr once `stream`'s queued work is done (other streams reuse it only then)."""
        check(lib().gpupool_deallocate(self._handle, ptr, _stream_handle(stream)))

    def record_stream(self, ptr: int, stream) -> None:
        """ptr is also used on `stream`: no reuse before that stream's work queued until the free."""
        check(lib().gpupool_record_stream(self._handle, ptr, _stream_handle(stream)))

    # ---- figures ----
    def stats(self, device: int = ALL_DEVICES) -> Stats:
        raw = CStats()
        raw.struct_size = ctypes.sizeof(CStats)
        check(lib().gpupool_get_stats(self._handle, device, ctypes.byref(raw)))
        return Stats(**{f.name: getattr(raw, f.name) for f in fields(Stats)})

    def reset_peaks(self, device: int) -> None:
        check(lib().gpupool_reset_peaks(self._handle, device))

    def report(self, device: int) -> dict:
        """The memory report (figures, fragmentation, recommendations) as a dict."""
        needed = ctypes.c_size_t()
        check(lib().gpupool_report_json(self._handle, device, None, 0, ctypes.byref(needed)))
        buffer = ctypes.create_string_buffer(needed.value)
        check(lib().gpupool_report_json(self._handle, device, buffer, needed.value, ctypes.byref(needed)))
        return json.loads(buffer.value.decode())

    def pressure(self, device: int) -> float:
        value = ctypes.c_double()
        check(lib().gpupool_pressure(self._handle, device, ctypes.byref(value)))
        return value.value

    # ---- control ----
    def trim(self, device: int, keep_bytes: int = 0) -> int:
        released = ctypes.c_size_t()
        check(lib().gpupool_trim(self._handle, device, keep_bytes, ctypes.byref(released)))
        return released.value

    def cleanup(self, device: int = ALL_DEVICES) -> int:
        released = ctypes.c_size_t()
        check(lib().gpupool_cleanup(self._handle, device, ctypes.byref(released)))
        return released.value

    def set_limit(self, device: int, nbytes: Optional[int]) -> None:
        check(lib().gpupool_set_limit(self._handle, device, NO_LIMIT if nbytes is None else nbytes))

    def limit(self, device: int) -> Optional[int]:
        value = ctypes.c_size_t()
        check(lib().gpupool_get_limit(self._handle, device, ctypes.byref(value)))
        return None if value.value == NO_LIMIT else value.value

    def set_cache_limit(self, device: int, nbytes: Optional[int]) -> None:
        check(lib().gpupool_set_cache_limit(self._handle, device, NO_LIMIT if nbytes is None else nbytes))

    def add_pressure_observer(self, threshold: float, observer: Callable[[int, float], None]) -> int:
        """Calls observer(device, pressure) when a device's pressure crosses threshold upwards
        (on the allocating thread). Returns an id for remove_pressure_observer."""
        trampoline = PRESSURE_CALLBACK(lambda device, pressure, _: observer(device, pressure))
        identifier = ctypes.c_uint64()
        check(lib().gpupool_add_pressure_observer(self._handle, threshold, trampoline, None,
                                                  ctypes.byref(identifier)))
        self._observers[identifier.value] = trampoline  # alive while registered
        return identifier.value

    def remove_pressure_observer(self, identifier: int) -> None:
        check(lib().gpupool_remove_pressure_observer(self._handle, identifier))
        self._observers.pop(identifier, None)
