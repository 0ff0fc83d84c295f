"""gpupool as CuPy's allocator.

    import gpupool.cupy
    gpupool.cupy.install()           # cupy.cuda.set_allocator with gpupool behind it

CuPy passes no stream to an allocator, so each allocation reads CuPy's current stream and is
ordered on it; a free is ordered on the stream current when CuPy frees (a different one than the
allocation's delays reuse until both are done).
"""
from typing import Optional

from ._pool import Pool


def install(pool: Optional[Pool] = None) -> Pool:
    """Routes CuPy's allocations on every device through `pool` (the process pool by default)."""
    import cupy

    pool = pool or Pool.process()

    def malloc(nbytes: int, device: int) -> int:
        if nbytes == 0:
            return 0
        return pool.allocate(device, nbytes, cupy.cuda.get_current_stream().ptr)

    def free(ptr: int, device: int) -> None:
        if ptr:
            pool.free(ptr, cupy.cuda.get_current_stream().ptr)

    allocator = cupy.cuda.memory.PythonFunctionAllocator(malloc, free)
    cupy.cuda.set_allocator(allocator.malloc)
    install.allocator = allocator  # CuPy keeps only the bound method: keep the object alive
    return pool
