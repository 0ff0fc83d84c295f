#!/usr/bin/env python3
"""Converts a PyTorch memory snapshot into a gpupool trace (CSV, docs/diagnostics.md), so that
`gpupool replay` runs a real workload's allocations under any pool configuration.

    # in the workload, with PyTorch's own allocator:
    torch.cuda.memory._record_memory_history(max_entries=1_000_000)
    ...  # the work
    pickle.dump(torch.cuda.memory._snapshot(), open("snapshot.pickle", "wb"))

    python3 tools/torch_snapshot_to_trace.py snapshot.pickle trace.csv [--device-memory BYTES]
    gpupool replay trace.csv --memory-limit 80GiB

Each `alloc` of the snapshot's device traces becomes an alloc (the size PyTorch recorded: its
request rounded to 512 bytes), each `free_requested` the free of that block, each `oom` an oom
event. The in-use and reserved columns are PyTorch's own running figures (live blocks; segments
mapped minus unmapped), so replay's "recorded" peak is PyTorch's peak reserved. The limit column
is --device-memory (default: the device's memory if the snapshot knows it, else 4x the peak
reserved): replay makes a simulated device that large. Needs only the standard library: the
snapshot is plain data. Frees of blocks allocated before recording began are counted and left out.
"""
import argparse
import csv
import pickle
import sys

HEADER = ["seq", "time_ns", "event", "device", "id", "bytes", "block_bytes", "precision", "stream",
          "in_use_bytes", "reserved_bytes", "limit_bytes"]


def convert(snapshot, device_memory=None):
    """Rows of the trace, and a count of frees whose allocation the recording did not see."""
    events, unmatched = [], 0
    for device, entries in enumerate(snapshot.get("device_traces", [])):
        live, in_use, reserved = {}, 0, 0
        for entry in entries:
            action, address, size = entry.get("action"), entry.get("addr", 0), entry.get("size", 0)
            time_us = entry.get("time_us", 0)
            if action in ("segment_alloc", "segment_map"):
                reserved += size
            elif action in ("segment_free", "segment_unmap"):
                reserved -= size
            elif action == "alloc" and size > 0:
                identifier = len(events) + 1
                live[address] = (identifier, size)
                in_use += size
                events.append([time_us, "alloc", device, identifier, size, entry.get("stream", 0), in_use, reserved])
            elif action == "free_requested":
                if address not in live:
                    unmatched += 1
                    continue
                identifier, block = live.pop(address)
                in_use -= block
                events.append([time_us, "free", device, identifier, block, entry.get("stream", 0), in_use, reserved])
            elif action == "oom":
                events.append([time_us, "oom", device, 0, size, entry.get("stream", 0), in_use, reserved])
    if not events:
        raise ValueError("the snapshot holds no allocations: was _record_memory_history on "
                         "before the work, with PyTorch's own allocator?")
    events.sort(key=lambda e: e[0])  # devices interleaved by time; stable within a device
    start = events[0][0]
    peak_reserved = max(e[7] for e in events)
    limit = device_memory or 4 * max(peak_reserved, max(e[6] for e in events))
    rows = [[seq, (time_us - start) * 1000, kind, device, identifier, size, size, "bytes", stream,
             in_use, reserved, limit]
            for seq, (time_us, kind, device, identifier, size, stream, in_use, reserved) in enumerate(events)]
    return rows, unmatched


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("snapshot")
    parser.add_argument("trace")
    parser.add_argument("--device-memory", type=int, help="bytes; the limit column")
    args = parser.parse_args()
    with open(args.snapshot, "rb") as source:
        snapshot = pickle.load(source)
    try:
        rows, unmatched = convert(snapshot, args.device_memory)
    except ValueError as error:
        sys.exit(f"torch_snapshot_to_trace: {args.snapshot}: {error}")
    with open(args.trace, "w", newline="") as out:
        writer = csv.writer(out, lineterminator="\n")
        writer.writerow(HEADER)
        writer.writerows(rows)
    allocations = sum(1 for r in rows if r[2] == "alloc")
    print(f"{args.trace}: {len(rows)} events ({allocations} allocations), "
          f"{unmatched} frees of blocks allocated before recording left out")


if __name__ == "__main__":
    main()
