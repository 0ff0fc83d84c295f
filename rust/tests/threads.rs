//! One pool shared by threads that allocate and free at the same time.
mod common;

use std::sync::Barrier;
use std::thread;

use common::setup;
use gpupool::Stream;

const THREADS: usize = 8;
const ROUNDS: usize = 200;

/// The sizes thread `thread` allocates, varied so that threads use several size classes.
fn size_of_round(thread: usize, round: usize) -> usize {
    1 + (thread * 7919 + round * 104_729) % 50_000
}

#[test]
fn threads_share_a_pool_and_the_figures_add_up() {
    let (device, _stream, pool) = setup();
    // Main joins the barrier too: once to look at the held blocks, once to let them go.
    let barrier = Barrier::new(THREADS + 1);
    let held_bytes = |thread: usize| 1000 * (thread + 1);

    thread::scope(|scope| {
        for thread in 0..THREADS {
            let (pool, barrier) = (pool.clone(), &barrier);
            scope.spawn(move || {
                let stream = Stream::new(device).unwrap();
                for round in 0..ROUNDS {
                    let block = pool
                        .allocate(device, size_of_round(thread, round), &stream)
                        .unwrap();
                    // SAFETY: simulated device memory is host memory; this thread owns the block.
                    unsafe { std::ptr::write_bytes(block.as_ptr().cast::<u8>(), thread as u8, block.len()) };
                }
                let held = pool.allocate(device, held_bytes(thread), &stream).unwrap();
                barrier.wait();
                barrier.wait();
                drop(held);
            });
        }
        barrier.wait();
        let during = pool.stats(device).unwrap();
        assert_eq!(during.live_allocations, THREADS as u64);
        assert_eq!(
            during.requested_bytes,
            (0..THREADS).map(held_bytes).sum::<usize>()
        );
        barrier.wait();
    });

    let after = pool.stats(device).unwrap();
    let per_thread = (ROUNDS + 1) as u64;
    assert_eq!(after.allocations, THREADS as u64 * per_thread);
    assert_eq!(after.frees, THREADS as u64 * per_thread);
    assert_eq!(after.live_allocations, 0);
    assert_eq!(after.requested_bytes, 0);
    assert_eq!(after.in_use_bytes, 0);
    assert_eq!(after.reserved_bytes, after.cached_bytes);
}

#[test]
fn allocations_can_be_freed_on_another_thread() {
    let (device, stream, pool) = setup();
    let blocks: Vec<_> = (1..=10)
        .map(|i| pool.allocate(device, i * 100, &stream).unwrap())
        .collect();
    thread::spawn(move || drop(blocks)).join().unwrap();
    let stats = pool.stats(device).unwrap();
    assert_eq!((stats.frees, stats.live_allocations), (10, 0));
}
