"""The Python module (python/gpupool) over libgpupool_c on simulated devices. Run by CTest with
GPUPOOL_LIBRARY and PYTHONPATH set; the torch and CuPy hooks run on the GPU machine
(bench/interop/)."""
import ctypes
import threading
import unittest

import gpupool


class PoolTest(unittest.TestCase):
    def setUp(self):
        self.device = gpupool.open_device("sim:64MiB")
        self.pool = gpupool.Pool()

    def test_allocate_free_and_figures(self):
        ptr = self.pool.allocate(self.device, 1000)
        self.assertEqual(ptr % 256, 0)
        ctypes.memset(ptr, 0x5A, 1000)  # a simulated device's memory is the host's
        big = self.pool.allocate(self.device, 3 << 20)
        stats = self.pool.stats(self.device)
        self.assertEqual(stats.live_allocations, 2)
        self.assertEqual(stats.requested_bytes, 1000 + (3 << 20))
        self.assertEqual(stats.reserved_bytes, stats.in_use_bytes + stats.cached_bytes)
        self.pool.free(ptr)
        self.pool.free(big)
        again = self.pool.allocate(self.device, 1000)
        self.assertGreaterEqual(self.pool.stats(self.device).cache_hits, 1)
        self.pool.free(again)
        self.assertGreater(self.pool.cleanup(self.device), 0)
        free, total = gpupool.device_memory(self.device)
        self.assertEqual((free, total), (64 << 20, 64 << 20))

    def test_virtual_segments_give_pages_back_between_live_blocks(self):
        pool = gpupool.Pool(segments="virtual")
        middle = pool.allocate(self.device, 16 << 20)
        end = pool.allocate(self.device, 1 << 20)
        pool.free(middle)
        self.assertEqual(pool.cleanup(self.device), 16 << 20)
        self.assertEqual(pool.stats(self.device).reserved_bytes, 2 << 20)
        pool.free(end)
        with self.assertRaises(ValueError):
            gpupool.Pool(segments="mapped")

    def test_errors_carry_status_and_message(self):
        with self.assertRaises(gpupool.GpuPoolError) as caught:
            self.pool.allocate(self.device, 0)
        self.assertEqual(caught.exception.kind, "invalid input")
        self.assertIn("bytes is 0", str(caught.exception))
        with self.assertRaises(gpupool.GpuPoolError) as caught:
            self.pool.allocate(self.device, 1 << 30)
        self.assertEqual(caught.exception.kind, "out of memory")
        self.assertIn("requested 1.00 GiB", str(caught.exception))
        ptr = self.pool.allocate(self.device, 64)
        self.pool.free(ptr)
        with self.assertRaises(gpupool.GpuPoolError) as caught:
            self.pool.free(ptr)
        self.assertEqual(caught.exception.kind, "invalid state")
        with self.assertRaises(gpupool.GpuPoolError):
            gpupool.open_device("tpu:0")
        with self.assertRaises(TypeError):
            self.pool.allocate(self.device, 64, stream="not a stream")

    def test_limits_trim_pressure_and_observers(self):
        seen = []
        identifier = self.pool.add_pressure_observer(0.5, lambda device, pressure: seen.append((device, pressure)))
        self.pool.set_limit(self.device, 4 << 20)
        self.assertEqual(self.pool.limit(self.device), 4 << 20)
        ptr = self.pool.allocate(self.device, 3 << 20)
        self.assertTrue(seen)
        self.assertEqual(seen[-1][0], self.device)
        self.assertGreaterEqual(self.pool.pressure(self.device), 0.75)
        with self.assertRaises(gpupool.GpuPoolError) as caught:
            self.pool.allocate(self.device, 2 << 20)
        self.assertEqual(caught.exception.kind, "pool limit exceeded")
        self.pool.free(ptr)
        self.assertGreaterEqual(self.pool.trim(self.device), 3 << 20)
        self.pool.remove_pressure_observer(identifier)
        self.pool.set_limit(self.device, None)
        self.assertEqual(self.pool.limit(self.device), 64 << 20)
        self.pool.set_cache_limit(self.device, 0)

    def test_report(self):
        ptr = self.pool.allocate(self.device, 5000)
        report = self.pool.report(self.device)
        self.assertEqual(report["devices"][0]["used_bytes"], 5120)
        self.assertTrue(report["devices"][0]["recommendations"])
        self.pool.free(ptr)

    def test_threads_share_a_pool(self):
        failures = []

        def work(seed):
            try:
                for i in range(300):
                    ptr = self.pool.allocate(self.device, 256 + (i * 97 + seed) % 50000)
                    self.pool.free(ptr)
            except gpupool.GpuPoolError as error:
                failures.append(error)

        threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        self.assertEqual(failures, [])
        stats = self.pool.stats(self.device)
        self.assertEqual((stats.allocations, stats.frees, stats.live_allocations), (1200, 1200, 0))

    def test_process_pool_is_what_the_framework_hooks_use(self):  # (their failures throw: C++ only)
        lib = ctypes.CDLL(gpupool.library_path())
        lib.gpupool_torch_malloc.restype = ctypes.c_void_p
        lib.gpupool_torch_malloc.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        lib.gpupool_torch_free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        ptr = lib.gpupool_torch_malloc(4096, self.device, None)
        self.assertTrue(ptr)
        process = gpupool.Pool.process()
        self.assertEqual(process.stats(self.device).live_allocations, 1)
        lib.gpupool_torch_free(ptr, 4096, self.device, None)
        self.assertEqual(process.stats(self.device).live_allocations, 0)


if __name__ == "__main__":
    unittest.main()
