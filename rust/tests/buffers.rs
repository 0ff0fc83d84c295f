//! Allocating managed buffers, returning them, and the figures they leave, on simulated devices.
mod common;

use common::setup;
use gpupool::{Device, ErrorKind, ManagedBuffer, Precision, Stream, ALIGNMENT};

#[test]
fn allocate_then_free_moves_the_figures_exactly() {
    let (device, stream, pool) = setup();

    let block = pool.allocate(device, 1000, &stream).unwrap();
    assert_eq!(block.len(), 1000);
    assert_eq!(block.device(), device);
    let live = pool.stats(device).unwrap();
    assert_eq!(live.live_allocations, 1);
    assert_eq!(live.requested_bytes, 1000);
    assert_eq!(live.in_use_bytes, 1024, "1000 bytes take a block of 1 KiB");
    assert_eq!(live.allocations, 1);
    assert_eq!(live.frees, 0);
    assert_eq!(live.device_allocations, 1);

    drop(block);
    let freed = pool.stats(device).unwrap();
    assert_eq!(freed.live_allocations, 0);
    assert_eq!(freed.requested_bytes, 0);
    assert_eq!(freed.in_use_bytes, 0);
    assert_eq!(freed.frees, 1);
    assert_eq!(freed.cached_bytes, 1024, "the block stays cached for reuse");
    assert_eq!(freed.peak_in_use_bytes, 1024);
}

#[test]
fn a_freed_block_is_reused_from_the_cache() {
    let (device, stream, pool) = setup();
    let first = pool.allocate(device, 1000, &stream).unwrap();
    let address = first.as_ptr();
    first.free().unwrap();

    let second = pool.allocate(device, 1000, &stream).unwrap();
    assert_eq!(
        second.as_ptr(),
        address,
        "same stream: the block is reusable at once"
    );
    let stats = pool.stats(device).unwrap();
    assert_eq!(stats.cache_hits, 1);
    assert_eq!(stats.allocations, 2);
    assert_eq!(stats.device_allocations, 1, "the device was asked only once");
    assert_eq!(stats.live_allocations, 1);
}

#[test]
fn simulated_device_memory_is_writable_host_memory() {
    let (device, stream, pool) = setup();
    let block = pool.allocate(device, 4096, &stream).unwrap();
    assert_eq!(block.as_ptr() as usize % ALIGNMENT, 0);

    // SAFETY: a simulated device's memory is host memory; the block is live and owned here.
    let bytes = unsafe { std::slice::from_raw_parts_mut(block.as_ptr().cast::<u8>(), block.len()) };
    for (i, byte) in bytes.iter_mut().enumerate() {
        *byte = (i % 251) as u8;
    }
    let sum: u64 = bytes.iter().map(|&b| u64::from(b)).sum();
    let expected: u64 = (0..4096u64).map(|i| i % 251).sum();
    assert_eq!(sum, expected);
}

#[test]
fn total_stats_sum_every_device() {
    let (first_device, first_stream, pool) = setup();
    let second_device = common::sim_device();
    let second_stream = Stream::new(second_device).unwrap();

    let _a = pool.allocate(first_device, 1000, &first_stream).unwrap();
    let _b = pool.allocate(second_device, 3000, &second_stream).unwrap();
    let total = pool.total_stats().unwrap();
    assert_eq!(total.live_allocations, 2);
    assert_eq!(total.requested_bytes, 4000);
    assert_eq!(pool.stats(second_device).unwrap().requested_bytes, 3000);
}

#[test]
fn into_raw_and_from_raw_hand_ownership_over() {
    let (device, stream, pool) = setup();
    let ptr = pool.allocate(device, 1000, &stream).unwrap().into_raw();
    assert_eq!(
        pool.stats(device).unwrap().live_allocations,
        1,
        "into_raw does not free"
    );
    assert_eq!(pool.allocation_info(ptr).unwrap(), (1000, device));

    // SAFETY: `ptr` came from into_raw and nothing else owns it.
    let block = unsafe { ManagedBuffer::from_raw(&pool, ptr, &stream) }.unwrap();
    assert_eq!((block.as_ptr(), block.len(), block.device()), (ptr, 1000, device));
    drop(block);
    let stats = pool.stats(device).unwrap();
    assert_eq!(stats.live_allocations, 0);
    assert_eq!(stats.frees, 1);
}

#[test]
fn aligned_allocations_up_to_the_guaranteed_alignment() {
    let (device, stream, pool) = setup();
    let block = pool.allocate_aligned(device, 100, 128, &stream).unwrap();
    assert_eq!(block.as_ptr() as usize % 128, 0);
    assert_eq!(pool.stats(device).unwrap().requested_bytes, 100);
}

#[test]
fn default_stream_allocations() {
    let (device, _stream, pool) = setup();
    let default_stream = Stream::default_for(device);
    assert!(default_stream.as_raw().is_null());
    assert!(!default_stream.is_owned());
    let block = pool.allocate(device, 512, &default_stream).unwrap();
    assert_eq!(block.free_stream(), &default_stream);
    drop(block);
    assert_eq!(pool.stats(device).unwrap().frees, 1);
}

#[test]
fn trim_and_cleanup_give_cached_blocks_back() {
    let (device, stream, pool) = setup();
    for bytes in [1000, 5000, 20000] {
        drop(pool.allocate(device, bytes, &stream).unwrap());
    }
    let cached = pool.stats(device).unwrap().cached_bytes;
    assert_eq!(cached, 1024 + 5120 + 20480);

    let trimmed = pool.trim(device, 10_000).unwrap();
    assert!(trimmed > 0, "something above 10000 bytes had to go");
    assert!(pool.stats(device).unwrap().cached_bytes <= 10_000);

    let cleaned = pool.emergency_cleanup(device).unwrap();
    assert_eq!(trimmed + cleaned, cached);
    let stats = pool.stats(device).unwrap();
    assert_eq!(stats.cached_bytes, 0);
    assert_eq!(stats.reserved_bytes, 0);
    assert_eq!(
        pool.emergency_cleanup_all().unwrap(),
        0,
        "nothing left to give back"
    );
}

#[test]
fn reset_peaks_lowers_the_peaks_to_the_present() {
    let (device, stream, pool) = setup();
    drop(pool.allocate(device, 100_000, &stream).unwrap());
    pool.emergency_cleanup(device).unwrap();
    assert!(pool.stats(device).unwrap().peak_in_use_bytes >= 100_000);

    pool.reset_peaks(device).unwrap();
    let stats = pool.stats(device).unwrap();
    assert_eq!(stats.peak_in_use_bytes, 0);
    assert_eq!(stats.peak_reserved_bytes, 0);
}

#[test]
fn limits_are_read_back_and_pressure_follows_them() {
    let (device, stream, pool) = setup();
    assert_eq!(pool.max_pool_size(device).unwrap(), gpupool::NO_LIMIT);
    pool.set_max_pool_size(device, 1 << 20).unwrap();
    assert_eq!(pool.max_pool_size(device).unwrap(), 1 << 20);

    let _block = pool.allocate(device, 512 << 10, &stream).unwrap();
    let pressure = pool.memory_pressure(device).unwrap();
    assert_eq!(pressure, 0.5, "512 KiB reserved of a 1 MiB limit");

    pool.set_max_cached_bytes(device, 0).unwrap();
    drop(pool.allocate(device, 1000, &stream).unwrap());
    assert_eq!(
        pool.stats(device).unwrap().cached_bytes,
        0,
        "a cache cap of 0 keeps nothing"
    );
}

#[test]
fn device_memory_is_the_simulated_size() {
    let device = Device::open("sim:32MiB").unwrap();
    let (free, total) = device.memory().unwrap();
    assert_eq!(total, 32 << 20);
    assert!(free <= total);
    assert!(device.id() >= 100, "simulated devices have ids from 100");
}

#[test]
fn get_managed_buffer_allocates_elements_of_a_precision() {
    let (device, stream, pool) = setup();
    let cases = [
        (Precision::Fp32, 4),
        (Precision::Fp16, 2),
        (Precision::Bf16, 2),
        (Precision::Int8, 1),
        (Precision::Bytes, 1),
    ];
    let mut requested = 0;
    let mut buffers = Vec::new();
    for (precision, size) in cases {
        assert_eq!(precision.size_bytes(), size);
        let buffer = pool.get_managed_buffer(device, 300, precision, &stream).unwrap();
        assert_eq!(buffer.precision(), precision);
        assert_eq!(buffer.element_count(), 300);
        assert_eq!(buffer.len(), 300 * size);
        requested += 300 * size;
        buffers.push(buffer);
    }
    let stats = pool.stats(device).unwrap();
    assert_eq!(stats.requested_bytes, requested);
    assert_eq!(stats.live_allocations, 5);
    assert_eq!(
        pool.allocation_info(buffers[0].as_ptr()).unwrap(),
        (1200, device),
        "the library sees bytes"
    );
    drop(buffers);
    assert_eq!(pool.stats(device).unwrap().live_allocations, 0);
}

#[test]
fn allocate_gives_byte_buffers() {
    let (device, stream, pool) = setup();
    let buffer = pool.allocate(device, 1001, &stream).unwrap();
    assert_eq!(buffer.precision(), Precision::Bytes);
    assert_eq!(buffer.element_count(), 1001);
    let ptr = buffer.into_raw();
    // SAFETY: `ptr` came from into_raw and nothing else owns it.
    let back = unsafe { ManagedBuffer::from_raw(&pool, ptr, &stream) }.unwrap();
    assert_eq!((back.precision(), back.element_count()), (Precision::Bytes, 1001));
}

#[test]
fn zero_elements_is_invalid_input_from_the_library() {
    let (device, stream, pool) = setup();
    let error = pool
        .get_managed_buffer(device, 0, Precision::Fp32, &stream)
        .unwrap_err();
    assert_eq!(error.kind(), ErrorKind::InvalidInput);
    assert_eq!(error.message(), "bytes is 0: expected at least 1");
    assert_eq!(pool.stats(device).unwrap().allocations, 0);
}

#[test]
fn an_element_count_whose_bytes_overflow_is_invalid_input() {
    let (device, stream, pool) = setup();
    let error = pool
        .get_managed_buffer(device, usize::MAX / 2, Precision::Fp32, &stream)
        .unwrap_err();
    assert_eq!(error.kind(), ErrorKind::InvalidInput);
    assert!(
        error.message().contains("fp32 elements overflow"),
        "{}",
        error.message()
    );
    assert_eq!(pool.stats(device).unwrap().allocations, 0);
}

#[test]
fn precision_names_match_the_library() {
    let names: Vec<String> = Precision::ALL.iter().map(ToString::to_string).collect();
    assert_eq!(names, ["fp32", "fp16", "bf16", "int8", "bytes"]);
}

#[test]
fn virtual_segments_give_pages_back_between_live_blocks() {
    let device = Device::open("sim:256MiB").unwrap();
    let pool = gpupool::GpuMemoryPool::new(&gpupool::Config::new().virtual_segments(true)).unwrap();
    let stream = Stream::default_for(device);
    let middle = pool.allocate(device, 16 << 20, &stream).unwrap();
    let end = pool.allocate(device, 1 << 20, &stream).unwrap();
    drop(middle);
    assert_eq!(pool.emergency_cleanup(device).unwrap(), 16 << 20);
    assert_eq!(pool.stats(device).unwrap().reserved_bytes, 2 << 20, "the page the live block touches");
    drop(end);
}
