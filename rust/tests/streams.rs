//! Streams: owned ones are destroyed with their last handle, frees can go to another stream,
//! and the JSON report.
mod common;

use std::ptr;

use common::setup;
use gpupool::{sys, ErrorKind, Stream};

#[test]
fn an_owned_stream_is_destroyed_with_its_last_handle() {
    let (device, _stream, pool) = setup();
    let stream = Stream::new(device).unwrap();
    assert!(stream.is_owned());
    assert!(!stream.as_raw().is_null());
    assert_eq!(stream.device(), device);
    stream.synchronize().unwrap();

    let raw = stream.as_raw();
    let clone = stream.clone();
    drop(stream);
    // SAFETY: the clone keeps the stream alive: it is still a stream of `device`.
    let borrowed = unsafe { Stream::from_raw(device, raw) };
    drop(pool.allocate(device, 100, &borrowed).unwrap());
    drop(clone);

    // The last owner is gone: gpupool no longer knows the stream.
    // SAFETY: `raw` is only compared against gpupool's registry, never used as a stream.
    let status = unsafe { sys::gpupool_stream_destroy(device.id(), raw) };
    assert_eq!(status, sys::GPUPOOL_INVALID_INPUT);
    let error = pool.allocate(device, 100, &borrowed).unwrap_err();
    assert_eq!(error.kind(), ErrorKind::InvalidInput);
    assert!(
        error.message().contains("is not a live stream"),
        "{}",
        error.message()
    );
}

#[test]
fn a_block_can_be_freed_on_another_stream() {
    let (device, first, pool) = setup();
    let second = Stream::new(device).unwrap();

    let mut block = pool.allocate(device, 1000, &first).unwrap();
    block.free_on(&second).unwrap();
    assert_eq!(block.free_stream(), &second);
    drop(block);
    let freed = pool.stats(device).unwrap();
    assert_eq!(
        (freed.frees, freed.live_allocations, freed.cached_bytes),
        (1, 0, 1024)
    );

    // The block waits for `second`'s work queued before the free; cleanup waits for such
    // pending frees, then gives every cached block back to the device.
    second.synchronize().unwrap();
    assert_eq!(pool.emergency_cleanup(device).unwrap(), 1024);
    let cleaned = pool.stats(device).unwrap();
    assert_eq!(
        (cleaned.cached_bytes, cleaned.reserved_bytes, cleaned.device_frees),
        (0, 0, 1)
    );
}

#[test]
fn a_recorded_stream_stays_alive_until_the_free() {
    let (device, stream, pool) = setup();
    let mut block = pool.allocate(device, 1000, &stream).unwrap();
    let user = Stream::new(device).unwrap();
    block.record_stream(&user).unwrap();
    let raw = user.as_raw();
    drop(user);

    // The allocation holds the recorded stream: it is still live for gpupool.
    // SAFETY: kept alive by `block`, a stream of `device`.
    let borrowed = unsafe { Stream::from_raw(device, raw) };
    drop(pool.allocate(device, 10, &borrowed).unwrap());
    block.free().unwrap();
    assert_eq!(pool.stats(device).unwrap().live_allocations, 0);
}

#[test]
fn recording_an_unknown_stream_fails() {
    let (device, stream, pool) = setup();
    let mut block = pool.allocate(device, 1000, &stream).unwrap();
    let mut bogus_target = 0u8;
    // SAFETY: the pointer is never used as a stream: gpupool checks it against its registry.
    let bogus = unsafe { Stream::from_raw(device, ptr::addr_of_mut!(bogus_target).cast()) };
    let error = block.record_stream(&bogus).unwrap_err();
    assert_eq!(error.kind(), ErrorKind::InvalidInput);
}

#[test]
fn the_json_report_lists_the_device() {
    let (device, stream, pool) = setup();
    let _block = pool.allocate(device, 1000, &stream).unwrap();
    let json = pool.report_json(device).unwrap();
    assert!(json.trim_start().starts_with('{'), "{json}");
    assert!(json.contains("\"devices\""), "{json}");
    assert!(
        json.contains(&format!("\"device_id\": {}", device.id())),
        "{json}"
    );
    assert!(json.contains("\"requested_bytes\": 1000"), "{json}");
}

#[test]
fn a_block_freed_on_another_stream_returns_to_its_own_streams_cache() {
    let (device, first, pool) = setup();
    let second = Stream::new(device).unwrap();

    let mut block = pool.allocate(device, 1000, &first).unwrap();
    let address = block.as_ptr();
    block.free_on(&second).unwrap();
    drop(block);

    // Not reused on the free stream: the block goes back to `first`'s cache once `second`'s
    // work queued before the free has finished.
    let on_second = pool.allocate(device, 1000, &second).unwrap();
    assert_ne!(on_second.as_ptr(), address);
    second.synchronize().unwrap();
    let on_first = pool.allocate(device, 1000, &first).unwrap();
    assert_eq!(
        on_first.as_ptr(),
        address,
        "back in the allocation stream's cache"
    );
}
