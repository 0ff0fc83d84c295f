//! Safe Rust bindings to gpupool, a caching pool of GPU memory, through its C ABI
//! (`include/gpupool/gpupool.h`, library `libgpupool_c`).
//!
//! - [`Device`]: a CUDA ordinal, or a simulated device (`"sim:64MiB"`) whose memory is host
//!   memory — for tests and machines without a GPU.
//! - [`Stream`]: the stream allocations are ordered on; owned (destroyed with its last clone) or
//!   borrowed from another library.
//! - [`Pool`]: a shared, thread-safe handle to a pool, made from a [`Config`], the environment, or
//!   the process pool. It allocates, reports [`Stats`] and JSON, trims, limits, and calls
//!   pressure observers.
//! - [`Allocation`]: an owned block, freed (stream-ordered) when dropped.
//! - [`Error`]: every failure, with its [`ErrorKind`] and the library's message.
//! - [`sys`]: the raw declarations, to hand pools and pointers to C code.
//!
//! ```
//! use gpupool::{Config, Device, Pool, Stream};
//!
//! # fn main() -> gpupool::Result<()> {
//! let device = Device::open("sim:64MiB")?;
//! let stream = Stream::new(device)?;
//! let pool = Pool::new(&Config::new())?;
//!
//! let block = pool.allocate(device, 1000, &stream)?;
//! assert_eq!(block.len(), 1000);
//! assert_eq!(pool.stats(device)?.live_allocations, 1);
//!
//! drop(block); // freed on `stream`, kept in the pool's cache
//! let again = pool.allocate(device, 1000, &stream)?;
//! assert_eq!(pool.stats(device)?.cache_hits, 1);
//!
//! let error = pool.allocate(device, 0, &stream).unwrap_err();
//! assert_eq!(error.kind(), gpupool::ErrorKind::InvalidInput);
//! # drop(again);
//! # Ok(())
//! # }
//! ```
#![warn(missing_docs)]

mod allocation;
mod config;
mod device;
mod error;
mod observer;
mod pool;
mod stats;
mod stream;
pub mod sys;

pub use allocation::Allocation;
pub use config::Config;
pub use device::Device;
pub use error::{Error, ErrorKind, Result};
pub use observer::{ObserverId, PressureObserver};
pub use pool::Pool;
pub use stats::Stats;
pub use stream::Stream;

/// Every block is aligned to this many bytes (as `cudaMalloc`'s); larger alignments are refused.
pub const ALIGNMENT: usize = sys::GPUPOOL_ALIGNMENT;

/// "No limit" for byte limits: for [`Config::max_pool_size`] and [`Pool::set_limit`] the
/// device's memory, for [`Config::max_cached_bytes`] and [`Pool::set_cache_limit`] no cap.
pub const NO_LIMIT: usize = sys::GPUPOOL_NO_LIMIT;
