"""gpupool from Python: the pool of libgpupool_c through ctypes, and gpupool as PyTorch's and
CuPy's allocator (gpupool.torch, gpupool.cupy).

    import gpupool
    pool = gpupool.Pool(max_pool_size=8 << 30)
    device = gpupool.open_device("cuda:0")          # or "sim:1GiB" without a GPU
    ptr = pool.allocate(device, 1 << 20)
    pool.free(ptr)
    print(pool.stats(device).in_use_bytes, pool.report(device)["devices"][0]["recommendations"])

Errors raise gpupool.GpuPoolError with gpupool's message and status. The library is found from
GPUPOOL_LIBRARY (a path), else next to this package when installed, else the system's loader.
"""
from ._library import GpuPoolError, library_path
from ._pool import Pool, Stats, open_device, device_memory

__all__ = ["GpuPoolError", "Pool", "Stats", "open_device", "device_memory", "library_path"]
