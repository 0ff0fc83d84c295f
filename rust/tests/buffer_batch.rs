//! Buffer batches: all or nothing, freed together, buffers handed out with `remove`.
mod common;

use common::setup;
use gpupool::{BufferBatch, BufferRequest, ErrorKind, Precision};

#[test]
fn a_batch_allocates_every_request_in_order() {
    let (device, stream, pool) = setup();
    let requests = [
        BufferRequest::new(1024, Precision::Fp32),
        BufferRequest::new(512, Precision::Fp16),
        BufferRequest::bytes(2048),
    ];
    let batch = pool.create_buffer_batch(device, &requests, &stream).unwrap();
    assert_eq!(batch.len(), 3);
    assert!(!batch.is_empty());
    assert_eq!(batch.total_bytes(), 4096 + 1024 + 2048);
    let shapes: Vec<_> = batch
        .iter()
        .map(|b| (b.element_count(), b.precision(), b.len(), b.device()))
        .collect();
    assert_eq!(
        shapes,
        [
            (1024, Precision::Fp32, 4096, device),
            (512, Precision::Fp16, 1024, device),
            (2048, Precision::Bytes, 2048, device),
        ]
    );
    assert_eq!(batch.get(1).unwrap().len(), 1024);
    assert!(batch.get(3).is_none());

    let live = pool.stats(device).unwrap();
    assert_eq!(live.live_allocations, 3);
    assert_eq!(live.allocations, 3);
    assert_eq!(live.requested_bytes, 7168);
    assert_eq!(live.in_use_bytes, 7168);
    assert_eq!(live.frees, 0);

    drop(batch);
    let freed = pool.stats(device).unwrap();
    assert_eq!(freed.live_allocations, 0);
    assert_eq!(freed.frees, 3);
    assert_eq!(freed.in_use_bytes, 0);
    assert_eq!(
        freed.cached_bytes, 7168,
        "the batch's buffers return to the cache"
    );
}

#[test]
fn a_failing_request_leaves_nothing_held_and_is_named() {
    let (device, stream, pool) = setup();
    pool.set_max_pool_size(device, 1 << 20).unwrap();
    let requests = [
        BufferRequest::bytes(256 << 10),
        BufferRequest::new(64 << 10, Precision::Fp32), // 256 KiB
        BufferRequest::bytes(768 << 10),               // past the 1 MiB limit
        BufferRequest::bytes(1024),
    ];
    let error = pool.create_buffer_batch(device, &requests, &stream).unwrap_err();
    assert_eq!(error.kind(), ErrorKind::PoolLimitExceeded);
    assert!(
        error.message().starts_with("buffer batch request 2 of 4: "),
        "{}",
        error.message()
    );
    assert!(
        error.message().contains("pool limit of 1.00 MiB"),
        "the library's message follows: {}",
        error.message()
    );

    let stats = pool.stats(device).unwrap();
    assert_eq!(stats.live_allocations, 0, "all or nothing");
    assert_eq!(stats.allocations, 2, "the fourth request was never made");
    assert_eq!(stats.frees, 2);
    assert_eq!(stats.in_use_bytes, 0);
}

#[test]
fn a_zero_element_request_fails_the_batch() {
    let (device, stream, pool) = setup();
    let requests = [BufferRequest::bytes(100), (0, Precision::Fp16).into()];
    let error = pool.create_buffer_batch(device, &requests, &stream).unwrap_err();
    assert_eq!(error.kind(), ErrorKind::InvalidInput);
    assert_eq!(
        error.message(),
        "buffer batch request 1 of 2: bytes is 0: expected at least 1"
    );
    assert_eq!(pool.stats(device).unwrap().live_allocations, 0);
}

#[test]
fn remove_hands_a_buffer_out_that_outlives_the_batch() {
    let (device, stream, pool) = setup();
    let requests = [
        BufferRequest::bytes(1000),
        BufferRequest::bytes(2000),
        BufferRequest::bytes(3000),
    ];
    let mut batch = pool.create_buffer_batch(device, &requests, &stream).unwrap();
    let kept = batch.remove(1).unwrap();
    assert_eq!(kept.len(), 2000);
    assert_eq!(batch.len(), 2);
    assert_eq!(batch.get(1).unwrap().len(), 3000, "later buffers move down");
    assert_eq!(batch.total_bytes(), 4000);
    assert!(batch.remove(2).is_none());

    drop(batch);
    let stats = pool.stats(device).unwrap();
    assert_eq!((stats.live_allocations, stats.requested_bytes), (1, 2000));

    // SAFETY: simulated device memory is host memory; `kept` is live and owned here.
    unsafe { std::ptr::write_bytes(kept.as_ptr().cast::<u8>(), 0x5A, kept.len()) };
    kept.free().unwrap();
    let stats = pool.stats(device).unwrap();
    assert_eq!((stats.live_allocations, stats.frees), (0, 3));
}

#[test]
fn push_takes_buffers_in_and_the_batch_frees_them() {
    let (device, stream, pool) = setup();
    let mut batch = BufferBatch::new();
    assert!(batch.is_empty());
    batch.push(pool.allocate(device, 1000, &stream).unwrap());
    batch.push(
        pool.get_managed_buffer(device, 10, Precision::Bf16, &stream)
            .unwrap(),
    );
    let empty = pool.create_buffer_batch(device, &[], &stream).unwrap();
    assert!(empty.is_empty());
    assert_eq!((batch.len(), batch.total_bytes()), (2, 1020));
    assert_eq!(pool.stats(device).unwrap().live_allocations, 2);

    let mut handed_out = batch.into_vec();
    let last = handed_out.pop().unwrap();
    drop(handed_out);
    assert_eq!(pool.stats(device).unwrap().live_allocations, 1);
    let batch: BufferBatch = std::iter::once(last).collect();
    drop(batch);
    assert_eq!(pool.stats(device).unwrap().live_allocations, 0);
}
