"""tools/torch_snapshot_to_trace.py on a snapshot in PyTorch's format (as _snapshot() returns
it: plain dicts), and `gpupool replay` of the result when GPUPOOL_CLI names the command."""
import os
import pickle
import subprocess
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools"))
import torch_snapshot_to_trace as converter  # noqa: E402


def snapshot():
    trace = [
        {"action": "segment_alloc", "addr": 0x1000000, "size": 2 << 20, "stream": 0, "time_us": 10},
        {"action": "alloc", "addr": 0x1000000, "size": 512, "stream": 0, "time_us": 11},
        {"action": "alloc", "addr": 0x1000200, "size": 1 << 20, "stream": 0, "time_us": 12},
        {"action": "free_requested", "addr": 0x1000000, "size": 512, "stream": 0, "time_us": 13},
        {"action": "free_completed", "addr": 0x1000000, "size": 512, "stream": 0, "time_us": 13},
        {"action": "free_requested", "addr": 0x7000000, "size": 4096, "stream": 0, "time_us": 14},
        {"action": "oom", "addr": 0, "size": 1 << 40, "stream": 0, "time_us": 15, "device_free": 0},
        {"action": "free_requested", "addr": 0x1000200, "size": 1 << 20, "stream": 0, "time_us": 16},
    ]
    return {"segments": [], "device_traces": [trace]}


class ConverterTest(unittest.TestCase):
    def test_rows_follow_the_snapshot(self):
        rows, unmatched = converter.convert(snapshot(), device_memory=1 << 30)
        self.assertEqual(unmatched, 1)  # the block allocated before recording
        self.assertEqual([r[2] for r in rows], ["alloc", "alloc", "free", "oom", "free"])
        self.assertEqual([r[0] for r in rows], list(range(5)))
        self.assertEqual(rows[0][1], 0)
        self.assertEqual(rows[2][4], rows[0][4])  # the free names its allocation's id
        self.assertEqual(rows[1][9], 512 + (1 << 20))  # in use after the second alloc
        self.assertEqual({r[10] for r in rows}, {2 << 20})  # PyTorch's reserved
        self.assertEqual({r[11] for r in rows}, {1 << 30})

    def test_an_empty_snapshot_is_refused(self):
        with self.assertRaises(ValueError):
            converter.convert({"device_traces": [[]]})

    @unittest.skipUnless(os.environ.get("GPUPOOL_CLI"), "GPUPOOL_CLI names the gpupool command")
    def test_gpupool_replays_the_converted_trace(self):
        with tempfile.TemporaryDirectory() as folder:
            source, trace = os.path.join(folder, "s.pickle"), os.path.join(folder, "t.csv")
            with open(source, "wb") as out:
                pickle.dump(snapshot(), out)
            subprocess.run([sys.executable, converter.__file__, source, trace, "--device-memory",
                            str(1 << 30)], check=True, capture_output=True)
            done = subprocess.run([os.environ["GPUPOOL_CLI"], "replay", trace], capture_output=True, text=True)
            self.assertEqual(done.returncode, 0, done.stderr)
            self.assertIn("5 (2 allocations, 2 frees", done.stdout)
            self.assertIn("1 recorded", done.stdout)  # the oom


if __name__ == "__main__":
    unittest.main()
