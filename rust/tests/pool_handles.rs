//! Pool handles: clones share one pool, buffers keep it alive, the process pool is borrowed.
mod common;

use common::setup;
use gpupool::{GpuMemoryPool, ManagedBuffer, Stats, Stream};

fn assert_send_sync<T: Send + Sync>() {}

#[test]
fn handles_are_send_and_sync() {
    assert_send_sync::<GpuMemoryPool>();
    assert_send_sync::<ManagedBuffer>();
    assert_send_sync::<Stream>();
    assert_send_sync::<gpupool::BufferBatch>();
    assert_send_sync::<gpupool::GpuError>();
}

#[test]
fn clones_share_one_pool() {
    let (device, stream, pool) = setup();
    let clone = pool.clone();
    assert_eq!(clone, pool);
    assert_eq!(clone.as_raw(), pool.as_raw());

    let _block = clone.allocate(device, 1000, &stream).unwrap();
    drop(clone);
    assert_eq!(
        pool.stats(device).unwrap().live_allocations,
        1,
        "seen through the other handle"
    );
}

#[test]
fn an_allocation_outlives_every_pool_handle() {
    let (device, stream, pool) = setup();
    let block = pool.allocate(device, 2000, &stream).unwrap();
    drop(pool);

    // The allocation's own handle keeps the pool alive: its figures and memory still work.
    // SAFETY: simulated device memory is host memory; the block is live and owned here.
    unsafe { std::ptr::write_bytes(block.as_ptr().cast::<u8>(), 0xAB, block.len()) };
    let pool = block.pool().clone();
    assert_eq!(pool.stats(device).unwrap().requested_bytes, 2000);
    block.free().unwrap();
    let stats = pool.stats(device).unwrap();
    assert_eq!((stats.live_allocations, stats.frees), (0, 1));
}

#[test]
fn a_borrowed_raw_pool_is_the_same_pool() {
    let (device, stream, pool) = setup();
    // SAFETY: `pool` keeps the raw pool alive during the call.
    let borrowed = unsafe { GpuMemoryPool::from_borrowed_raw(pool.as_raw()) };
    assert_eq!(borrowed, pool);
    drop(pool);
    // `borrowed` took its own reference: the pool is still usable after the first handle went.
    let block = borrowed.allocate(device, 100, &stream).unwrap();
    assert_eq!(borrowed.stats(device).unwrap().live_allocations, 1);
    drop(block);
}

#[test]
fn the_process_pool_is_one_pool_and_survives_its_handles() {
    let device = common::sim_device();
    let stream = Stream::new(device).unwrap();
    let first = GpuMemoryPool::process().unwrap();
    let block = first.allocate(device, 4096, &stream).unwrap();
    drop(first);
    drop(block);

    // Were its handles not balanced (released without a retain), the process pool would be
    // gone by now.
    let second = GpuMemoryPool::process().unwrap();
    assert_eq!(second, GpuMemoryPool::process().unwrap());
    let stats: Stats = second.stats(device).unwrap();
    assert_eq!(
        (stats.allocations, stats.frees, stats.live_allocations),
        (1, 1, 0)
    );
}
