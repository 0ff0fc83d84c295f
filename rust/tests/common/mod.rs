//! Helpers shared by the integration tests: every test runs on its own simulated device, so the
//! per-device figures it asserts are its own.
#![allow(dead_code)] // each test file uses a different subset

use gpupool::{Config, Device, GpuMemoryPool, Stream};

/// A new simulated device of 64 MiB.
pub fn sim_device() -> Device {
    Device::open("sim:64MiB").expect("simulated devices are always available")
}

/// A new pool with the default config.
pub fn new_pool() -> GpuMemoryPool {
    GpuMemoryPool::new(&Config::new()).expect("the default config is valid")
}

/// A new simulated device, a stream of it and a new pool.
pub fn setup() -> (Device, Stream, GpuMemoryPool) {
    let device = sim_device();
    let stream = Stream::new(device).expect("simulated devices make streams");
    (device, stream, new_pool())
}
