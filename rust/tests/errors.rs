//! Failures: their kind, the library's message, and that nothing leaks from them.
mod common;

use common::setup;
use gpupool::{Config, Device, ErrorKind, GpuMemoryPool, ManagedBuffer, Stream};

#[test]
fn zero_bytes_is_invalid_input() {
    let (device, stream, pool) = setup();
    let error = pool.allocate(device, 0, &stream).unwrap_err();
    assert_eq!(error.kind(), ErrorKind::InvalidInput);
    assert_eq!(error.message(), "bytes is 0: expected at least 1");
    assert_eq!(
        error.to_string(),
        "gpupool: invalid input: bytes is 0: expected at least 1"
    );
    assert_eq!(pool.stats(device).unwrap().allocations, 0);
}

#[test]
fn an_unknown_device_is_named_in_the_error() {
    let (_device, stream, pool) = setup();
    let unknown = Device::from_id(12345);
    let error = pool.allocate(unknown, 1000, &stream).unwrap_err();
    assert_eq!(error.kind(), ErrorKind::InvalidInput);
    assert!(
        error.message().contains("device 12345 is not open"),
        "{}",
        error.message()
    );

    let error = pool.stats(unknown).unwrap_err();
    assert_eq!(error.kind(), ErrorKind::InvalidInput);
    assert!(unknown.memory().is_err());
}

#[test]
fn malformed_device_specs_are_refused() {
    assert!(Device::open("sim:lots").is_err());
    let error = Device::open("sim\0:1MiB").unwrap_err();
    assert_eq!(error.kind(), ErrorKind::InvalidInput);
    assert!(error.message().contains("NUL"), "{}", error.message());
}

#[test]
fn freeing_twice_is_invalid_state() {
    let (device, stream, pool) = setup();
    let ptr = pool.allocate(device, 1000, &stream).unwrap().into_raw();
    // SAFETY: `ptr` came from into_raw and nothing else owns it.
    let owner = unsafe { ManagedBuffer::from_raw(&pool, ptr, &stream) }.unwrap();
    owner.free().unwrap();

    // SAFETY: deliberately taking back a freed pointer: gpupool must refuse it.
    let error = unsafe { ManagedBuffer::from_raw(&pool, ptr, &stream) }.unwrap_err();
    assert_eq!(error.kind(), ErrorKind::InvalidState);
    assert!(
        error.message().contains("not a live allocation"),
        "{}",
        error.message()
    );
    assert_eq!(
        pool.stats(device).unwrap().frees,
        1,
        "the refused free counts nothing"
    );
}

#[test]
fn a_second_owner_of_the_same_pointer_fails_to_free_it() {
    let (device, stream, pool) = setup();
    let ptr = pool.allocate(device, 1000, &stream).unwrap().into_raw();
    // SAFETY: breaking from_raw's contract on purpose (two owners), with no allocation between
    // the two frees, to see gpupool catch the double free.
    let (first, second) = unsafe {
        (
            ManagedBuffer::from_raw(&pool, ptr, &stream).unwrap(),
            ManagedBuffer::from_raw(&pool, ptr, &stream).unwrap(),
        )
    };
    first.free().unwrap();
    let error = second.free().unwrap_err();
    assert_eq!(error.kind(), ErrorKind::InvalidState);
    assert!(error.message().contains("already freed"), "{}", error.message());
}

#[test]
fn passing_the_pool_limit() {
    let (device, stream, pool) = setup();
    pool.set_max_pool_size(device, 1 << 20).unwrap();
    let _kept = pool.allocate(device, 600 << 10, &stream).unwrap();

    let error = pool.allocate(device, 600 << 10, &stream).unwrap_err();
    assert_eq!(error.kind(), ErrorKind::PoolLimitExceeded);
    assert!(
        error.message().contains("pool limit of 1.00 MiB"),
        "{}",
        error.message()
    );
    let stats = pool.stats(device).unwrap();
    assert_eq!(stats.live_allocations, 1);
    assert_eq!(stats.out_of_memory_errors, 1);
}

#[test]
fn alignments_above_the_guarantee_or_not_powers_of_two() {
    let (device, stream, pool) = setup();
    let error = pool.allocate_aligned(device, 100, 512, &stream).unwrap_err();
    assert_eq!(error.kind(), ErrorKind::Unsupported);
    assert!(
        error.message().contains("alignment 512 is above"),
        "{}",
        error.message()
    );

    let error = pool.allocate_aligned(device, 100, 3, &stream).unwrap_err();
    assert_eq!(error.kind(), ErrorKind::InvalidInput);
    assert_eq!(error.message(), "alignment 3 is not a power of two");
}

#[test]
fn an_invalid_config_names_the_field() {
    let error = GpuMemoryPool::new(&Config::new().critical_pressure(1.5)).unwrap_err();
    assert_eq!(error.kind(), ErrorKind::InvalidInput);
    assert!(
        error.message().starts_with("critical_pressure is 1.5"),
        "{}",
        error.message()
    );

    let error = GpuMemoryPool::new(&Config::new().max_pool_size(0)).unwrap_err();
    assert!(
        error.message().starts_with("max_pool_size is 0"),
        "{}",
        error.message()
    );
}

#[test]
fn a_stream_of_another_device_is_refused() {
    let (device, stream, pool) = setup();
    let other_device = common::sim_device();
    let other_stream = Stream::new(other_device).unwrap();

    let error = pool.allocate(device, 1000, &other_stream).unwrap_err();
    assert_eq!(error.kind(), ErrorKind::InvalidInput);

    let mut block = pool.allocate(device, 1000, &stream).unwrap();
    let error = block.free_on(&other_stream).unwrap_err();
    assert_eq!(error.kind(), ErrorKind::InvalidInput);
    assert!(
        error.message().contains("belongs to device"),
        "{}",
        error.message()
    );
    assert_eq!(block.free_stream(), &stream, "a refused stream changes nothing");
}

#[test]
fn errors_are_std_errors() {
    let (device, stream, pool) = setup();
    let error: Box<dyn std::error::Error + Send + Sync> =
        Box::new(pool.allocate(device, 0, &stream).unwrap_err());
    assert!(error.to_string().starts_with("gpupool: invalid input"));
    assert_eq!(ErrorKind::PoolLimitExceeded.to_string(), "pool limit exceeded");
}
