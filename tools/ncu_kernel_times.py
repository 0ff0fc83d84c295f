#!/usr/bin/env python3
# Sums `ncu --metrics gpu__time_duration.sum --csv --page raw` output by kernel: launches and
# microseconds per kernel name (ncu serialises kernels and locks clocks: compare runs with each
# other, not with wall times). Usage: tools/ncu_kernel_times.py FILE.csv
import csv, sys, collections
rows = list(csv.reader(open(sys.argv[1])))
hdr = None
agg = collections.OrderedDict()
for r in rows:
    if 'Kernel Name' in r:
        hdr = r; continue
    if hdr is None or len(r) != len(hdr): continue
    name = r[hdr.index('Kernel Name')][:90]
    try: v = float(r[hdr.index('gpu__time_duration.sum')].replace(',', ''))
    except: continue
    a = agg.setdefault(name, [0, 0.0]); a[0] += 1; a[1] += v
for n, (c, t) in agg.items(): print(f"{c:5d} {t/1e3:10.1f} us  {n}")
