"""Loading libgpupool_c and declaring the functions of include/gpupool/gpupool.h."""
import ctypes
import os
from pathlib import Path

ALL_DEVICES = -1
NO_LIMIT = ctypes.c_size_t(-1).value

_STATUS_NAMES = {
    0: "ok", 1: "invalid input", 2: "out of memory", 3: "pool limit exceeded",
    4: "device unavailable", 5: "CUDA error", 6: "unsupported", 7: "invalid state",
    8: "internal error",
}


class GpuPoolError(RuntimeError):
    """A gpupool call failed: `status` is gpupool_status's value, `kind` its name."""

    def __init__(self, status: int, message: str):
        self.status = status
        self.kind = _STATUS_NAMES.get(status, "unknown")
        super().__init__(f"{self.kind}: {message}")


class Config(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("max_pool_size", ctypes.c_size_t),
                ("max_cached_bytes", ctypes.c_size_t), ("initial_reservation", ctypes.c_size_t),
                ("caching", ctypes.c_int), ("critical_pressure", ctypes.c_double),
                ("segments", ctypes.c_int)]

SEGMENTS = {"device": 0, "virtual": 1, "none": 2}  # gpupool_config.segments


class CStats(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t)] + [
        (name, ctypes.c_size_t) for name in (
            "in_use_bytes", "requested_bytes", "cached_bytes", "reserved_bytes",
            "peak_in_use_bytes", "peak_reserved_bytes", "stranded_bytes")] + [
        (name, ctypes.c_uint64) for name in (
            "allocations", "frees", "cache_hits", "device_allocations", "device_frees",
            "out_of_memory_errors", "live_allocations")]


def _candidates():
    explicit = os.environ.get("GPUPOOL_LIBRARY")
    if explicit:
        yield explicit
        return
    here = Path(__file__).resolve().parent
    # Installed: <prefix>/lib/python3/site-packages/gpupool -> <prefix>/lib/libgpupool_c.so
    for up in (here.parent.parent.parent, here.parent.parent.parent.parent):
        yield str(up / "libgpupool_c.so")
        yield str(up / "lib" / "libgpupool_c.so")
    yield "libgpupool_c.so"


def _load():
    errors = []
    for candidate in _candidates():
        if os.sep in candidate and not os.path.exists(candidate):
            continue
        try:
            return ctypes.CDLL(candidate), candidate
        except OSError as error:
            errors.append(f"{candidate}: {error}")
    raise OSError("gpupool: libgpupool_c.so not found; set GPUPOOL_LIBRARY to its path"
                  + ("".join("\n  " + e for e in errors)))


_lib, _path = _load()


def library_path() -> str:
    """The path of the libgpupool_c this module loaded (what PyTorch's allocator hook needs)."""
    return _path


P = ctypes.c_void_p
SIZE = ctypes.c_size_t
PRESSURE_CALLBACK = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_double, P)

_SIGNATURES = {
    "gpupool_last_error": (ctypes.c_char_p, []),
    "gpupool_device_open": (ctypes.c_int, [ctypes.c_char_p, ctypes.POINTER(ctypes.c_int)]),
    "gpupool_device_memory": (ctypes.c_int, [ctypes.c_int, ctypes.POINTER(SIZE), ctypes.POINTER(SIZE)]),
    "gpupool_config_init": (None, [ctypes.POINTER(Config)]),
    "gpupool_pool_create": (ctypes.c_int, [ctypes.POINTER(Config), ctypes.POINTER(P)]),
    "gpupool_pool_create_from_environment": (ctypes.c_int, [ctypes.POINTER(P)]),
    "gpupool_pool_retain": (P, [P]),
    "gpupool_pool_release": (None, [P]),
    "gpupool_process_pool": (ctypes.c_int, [ctypes.POINTER(P)]),
    "gpupool_allocate": (ctypes.c_int, [P, ctypes.c_int, SIZE, P, ctypes.POINTER(P)]),
    "gpupool_deallocate": (ctypes.c_int, [P, P, P]),
    "gpupool_record_stream": (ctypes.c_int, [P, P, P]),
    "gpupool_get_stats": (ctypes.c_int, [P, ctypes.c_int, ctypes.POINTER(CStats)]),
    "gpupool_reset_peaks": (ctypes.c_int, [P, ctypes.c_int]),
    "gpupool_report_json": (ctypes.c_int, [P, ctypes.c_int, ctypes.c_char_p, SIZE, ctypes.POINTER(SIZE)]),
    "gpupool_trim": (ctypes.c_int, [P, ctypes.c_int, SIZE, ctypes.POINTER(SIZE)]),
    "gpupool_cleanup": (ctypes.c_int, [P, ctypes.c_int, ctypes.POINTER(SIZE)]),
    "gpupool_set_limit": (ctypes.c_int, [P, ctypes.c_int, SIZE]),
    "gpupool_get_limit": (ctypes.c_int, [P, ctypes.c_int, ctypes.POINTER(SIZE)]),
    "gpupool_set_cache_limit": (ctypes.c_int, [P, ctypes.c_int, SIZE]),
    "gpupool_pressure": (ctypes.c_int, [P, ctypes.c_int, ctypes.POINTER(ctypes.c_double)]),
    "gpupool_add_pressure_observer": (
        ctypes.c_int, [P, ctypes.c_double, PRESSURE_CALLBACK, P, ctypes.POINTER(ctypes.c_uint64)]),
    "gpupool_remove_pressure_observer": (ctypes.c_int, [P, ctypes.c_uint64]),
}
for _name, (_restype, _argtypes) in _SIGNATURES.items():
    _function = getattr(_lib, _name)
    _function.restype = _restype
    _function.argtypes = _argtypes


def lib():
    return _lib


def check(status: int) -> None:
    """Raises GpuPoolError for a failed call, with this thread's last gpupool error."""
    if status != 0:
        raise GpuPoolError(status, _lib.gpupool_last_error().decode("utf-8", "replace"))
