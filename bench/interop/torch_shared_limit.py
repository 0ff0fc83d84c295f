#!/usr/bin/env python3
"""PyTorch and gpupool buffers of the application in one process under one gpupool limit: with
GPUPOOL_MEMORY_LIMIT=8GiB, 3 GiB taken through gpupool directly leave PyTorch the rest, and
PyTorch's out-of-memory error comes at the limit, not at the device's end. Exits non-zero when
the limit does not hold for both.

    GPUPOOL_MEMORY_LIMIT=8GiB python3 bench/interop/torch_shared_limit.py
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))


def main():
    limit = 8 << 30
    os.environ["GPUPOOL_MEMORY_LIMIT"] = str(limit)
    import torch
    import gpupool.torch
    gpupool.torch.install()
    pool = gpupool.torch.pool()
    outside = pool.allocate(0, 3 << 30)  # the application's own buffer, beside PyTorch's
    chunk = 256 << 20
    tensors = []
    try:
        while len(tensors) < 1000:
            tensors.append(torch.empty(chunk, dtype=torch.uint8, device="cuda"))
    except (torch.OutOfMemoryError, MemoryError, RuntimeError) as error:  # gpupool's std::bad_alloc
        message = str(error).splitlines()[0]
        if "pool limit" not in message:
            sys.exit(f"PyTorch's allocation failed for another reason: {message}")
    else:
        sys.exit("PyTorch allocated 250 GiB under an 8 GiB limit")
    stats = pool.stats(0)
    torch_bytes = len(tensors) * chunk
    print(f"limit {limit >> 20} MiB: gpupool buffer 3072 MiB + PyTorch {torch_bytes >> 20} MiB "
          f"in {len(tensors)} tensors, then PyTorch's error: {message[:100]}")
    print(f"gpupool: in use {stats.in_use_bytes >> 20} MiB, reserved {stats.reserved_bytes >> 20} MiB, "
          f"peak reserved {stats.peak_reserved_bytes >> 20} MiB")
    held = stats.peak_reserved_bytes <= limit and (3 << 30) + torch_bytes <= limit
    filled = (3 << 30) + torch_bytes + chunk > limit * 0.9  # stopped near the limit, not long before
    del tensors
    pool.free(outside)
    print("the limit held for both" if held and filled else "the limit did NOT hold")
    sys.exit(0 if held and filled else 1)


if __name__ == "__main__":
    main()
