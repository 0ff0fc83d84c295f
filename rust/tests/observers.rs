//! Pressure observers: called with the device's id, kept until removed, dropped when removed.
mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use common::setup;
use gpupool::{ErrorKind, ObserverId};

/// Sets its flag when dropped: shows when the pool lets go of a closure.
struct DropFlag(Arc<AtomicUsize>);

impl Drop for DropFlag {
    fn drop(&mut self) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

#[test]
fn an_observer_is_called_with_the_device_id_and_pressure() {
    let (device, stream, pool) = setup();
    pool.set_max_pool_size(device, 1 << 20).unwrap();
    let calls = Arc::new(Mutex::new(Vec::new()));
    let seen = Arc::clone(&calls);
    pool.add_pressure_observer(
        0.5,
        Box::new(move |id, pressure| seen.lock().unwrap().push((id, pressure))),
    )
    .unwrap();

    let _below = pool.allocate(device, 256 << 10, &stream).unwrap();
    assert!(
        calls.lock().unwrap().is_empty(),
        "a quarter of the limit is below the threshold"
    );
    let _above = pool.allocate(device, 512 << 10, &stream).unwrap();
    assert_eq!(*calls.lock().unwrap(), vec![(device.id(), 0.75)]);
}

#[test]
fn a_removed_observer_is_dropped_and_no_longer_called() {
    let (device, stream, pool) = setup();
    pool.set_max_pool_size(device, 1 << 20).unwrap();
    let calls = Arc::new(AtomicUsize::new(0));
    let drops = Arc::new(AtomicUsize::new(0));
    let (counter, flag) = (Arc::clone(&calls), DropFlag(Arc::clone(&drops)));
    let id: ObserverId = pool
        .add_pressure_observer(
            0.5,
            Box::new(move |_, _| {
                let _keep = &flag;
                counter.fetch_add(1, Ordering::SeqCst);
            }),
        )
        .unwrap();

    pool.remove_pressure_observer(id).unwrap();
    assert_eq!(drops.load(Ordering::SeqCst), 1, "removing drops the closure");
    let _above = pool.allocate(device, 768 << 10, &stream).unwrap();
    assert_eq!(calls.load(Ordering::SeqCst), 0);

    let error = pool.remove_pressure_observer(id).unwrap_err();
    assert_eq!(error.kind(), ErrorKind::InvalidInput);
}

#[test]
fn observers_are_dropped_with_the_last_pool_handle() {
    let (_device, _stream, pool) = setup();
    let drops = Arc::new(AtomicUsize::new(0));
    let flag = DropFlag(Arc::clone(&drops));
    pool.add_pressure_observer(
        0.9,
        Box::new(move |_, _| {
            let _keep = &flag;
        }),
    )
    .unwrap();

    let clone = pool.clone();
    drop(pool);
    assert_eq!(drops.load(Ordering::SeqCst), 0, "a clone still holds the pool");
    drop(clone);
    assert_eq!(drops.load(Ordering::SeqCst), 1);
}

#[test]
fn a_threshold_outside_zero_to_one_is_refused() {
    let (_device, _stream, pool) = setup();
    let error = pool.add_pressure_observer(1.5, Box::new(|_, _| {})).unwrap_err();
    assert_eq!(error.kind(), ErrorKind::InvalidInput);
    assert!(
        error.message().starts_with("threshold is 1.5"),
        "{}",
        error.message()
    );
}

#[test]
fn a_panicking_observer_does_not_take_the_allocation_down() {
    let (device, stream, pool) = setup();
    pool.set_max_pool_size(device, 1 << 20).unwrap();
    let calls = Arc::new(AtomicUsize::new(0));
    let counter = Arc::clone(&calls);
    pool.add_pressure_observer(
        0.5,
        Box::new(move |_, _| {
            counter.fetch_add(1, Ordering::SeqCst);
            panic!("observer panics on purpose");
        }),
    )
    .unwrap();
    let block = pool.allocate(device, 768 << 10, &stream).unwrap();
    assert_eq!(calls.load(Ordering::SeqCst), 1, "the observer ran and panicked");
    assert_eq!(block.len(), 768 << 10);
    assert_eq!(pool.stats(device).unwrap().live_allocations, 1);
}
