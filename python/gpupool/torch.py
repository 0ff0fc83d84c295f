"""gpupool as PyTorch's CUDA allocator, over the process pool of libgpupool_c.

    import gpupool.torch
    gpupool.torch.install()          # before the first CUDA tensor
    ...
    print(gpupool.torch.stats(0))    # PyTorch's own memory stats are empty with a pluggable allocator

Cross-stream use: with a pluggable allocator PyTorch ignores Tensor.record_stream. install()
routes it to gpupool, so a tensor recorded on another stream is not reused until that stream's
work queued before its free has finished. record_stream calls made inside PyTorch's C++ (not
through the Python method) are not seen: synchronize those streams before freeing.
"""
from typing import Optional

from ._library import GpuPoolError, library_path
from ._pool import Pool, Stats

_INVALID_STATE = 7
_process_pool: Optional[Pool] = None


def install() -> None:
    """Makes gpupool PyTorch's CUDA allocator for this process. PyTorch accepts this only before
    it has allocated CUDA memory; a second call does nothing."""
    global _process_pool
    if _process_pool is not None:
        return
    import torch

    allocator = torch.cuda.memory.CUDAPluggableAllocator(
        library_path(), "gpupool_torch_malloc", "gpupool_torch_free")
    torch.cuda.memory.change_current_allocator(allocator)
    _process_pool = Pool.process()
    _route_record_stream(torch, _process_pool)


def _route_record_stream(torch, pool: Pool) -> None:
    original = torch.Tensor.record_stream

    def record_stream(tensor, stream):
        original(tensor, stream)
        storage = tensor.untyped_storage()
        if not tensor.is_cuda or storage.nbytes() == 0:
            return
        try:
            pool.record_stream(storage.data_ptr(), stream)
        except GpuPoolError as error:
            if error.status != _INVALID_STATE:  # memory gpupool does not own (DLPack, from_blob)
                raise

    torch.Tensor.record_stream = record_stream


def installed() -> bool:
    return _process_pool is not None


def pool() -> Pool:
    """The pool PyTorch allocates from once installed."""
    return _process_pool if _process_pool is not None else Pool.process()


def stats(device: int = -1) -> Stats:
    """gpupool's figures for a CUDA ordinal (all devices by default)."""
    return pool().stats(device)


def report(device: int) -> dict:
    return pool().report(device)
