#!/usr/bin/env python3
# Sums `ncu --metrics gpu__time_duration.sum --csv --page raw` output by kernel: launches and
# microseconds per kernel name (ncu serialises kernels and locks clocks: compare runs with each
# other, not with wall times). Usage: tools/ncu_kernel_times.py FILE.csv [--each]
# --each: one line per launch, in launch order, instead of the sums.
import collections
import csv
import sys

header = None
totals = collections.OrderedDict()
each = "--each" in sys.argv[2:]
for row in csv.reader(open(sys.argv[1])):
    if "Kernel Name" in row:
        header = row
        continue
    if header is None or len(row) != len(header):
        continue
    name = row[header.index("Kernel Name")][:90]
    try:
        ns = float(row[header.index("gpu__time_duration.sum")].replace(",", ""))
    except ValueError:
        continue  # the units row
    if each:
        print(f"{ns / 1e3:10.1f} us  {name}")
    total = totals.setdefault(name, [0, 0.0])
    total[0] += 1
    total[1] += ns
if not each:
    for name, (count, ns) in totals.items():
        print(f"{count:5d} {ns / 1e3:10.1f} us  {name}")
