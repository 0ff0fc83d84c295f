//! Pressure observers: Rust closures behind the C ABI's callback + `user_data`.
//!
//! gpupool copies an observer out of its list before calling it, outside its lock, so a call may
//! still be running on another thread after `gpupool_remove_pressure_observer` returned. A
//! pointer to the closure as `user_data` could then dangle. Instead `user_data` carries a token
//! into a process-wide table of shared closures: a call clones its closure out of the table and
//! runs it unlocked, removal takes it out of the table, and the closure is dropped when the last
//! running call ends. A call that comes after removal finds nothing and does nothing.
use std::collections::HashMap;
use std::ffi::{c_double, c_int, c_void};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

/// A pressure observer: called with the device's id and its pressure (reserved / limit) when the
/// pressure crosses the observer's threshold upwards, on the thread whose allocation crossed it.
pub type PressureObserver = Box<dyn Fn(i32, f64) + Send + Sync>;

/// Identifies a pressure observer of a pool, for
/// [`GpuMemoryPool::remove_pressure_observer`](crate::GpuMemoryPool::remove_pressure_observer).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ObserverId(pub(crate) u64);

impl ObserverId {
    /// The id the C ABI gave the observer.
    pub fn as_raw(self) -> u64 {
        self.0
    }
}

/// The key of a closure in the table, passed to C as `user_data` (an integer, never
/// dereferenced). Never reused, so a late call cannot reach a newer observer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Token(usize);

impl Token {
    pub(crate) fn as_user_data(self) -> *mut c_void {
        self.0 as *mut c_void
    }
}

type SharedObserver = Arc<PressureObserver>;

fn table() -> MutexGuard<'static, HashMap<Token, SharedObserver>> {
    static TABLE: OnceLock<Mutex<HashMap<Token, SharedObserver>>> = OnceLock::new();
    let table = TABLE.get_or_init(Default::default);
    // A panic cannot happen while the lock is held (only map operations run under it), but a
    // poisoned map would still be consistent: keep using it.
    table.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Puts `observer` in the table and returns its token.
pub(crate) fn register(observer: PressureObserver) -> Token {
    static NEXT_TOKEN: AtomicUsize = AtomicUsize::new(1);
    let token = Token(NEXT_TOKEN.fetch_add(1, Ordering::Relaxed));
    table().insert(token, Arc::new(observer));
    token
}

/// Takes the closure of `token` out of the table: no call starting later runs it, and it is
/// dropped once the calls already running have returned.
pub(crate) fn unregister(token: Token) {
    let removed = table().remove(&token);
    drop(removed); // outside the lock: the closure's drop may run arbitrary code
}

/// The `gpupool_pressure_callback` of every observer this crate registers.
pub(crate) unsafe extern "C" fn trampoline(device: c_int, pressure: c_double, user_data: *mut c_void) {
    let token = Token(user_data as usize);
    let observer = table().get(&token).cloned();
    let Some(observer) = observer else { return };
    // Unwinding into gpupool's C++ would abort the process in the middle of an allocation: a
    // panicking observer is reported by the panic hook and otherwise ignored.
    let _ = catch_unwind(AssertUnwindSafe(|| observer(device, pressure)));
}
