//! Safe Rust bindings to gpupool, a caching pool of GPU memory, through its C ABI
//! (`include/gpupool/gpupool.h`, library `libgpupool_c`): the seed API the Rust way.
//!
//! - [`GpuMemoryPool`]: a shared, thread-safe handle to a pool, made from a [`Config`], the
//!   environment, or the process pool. It hands out [`ManagedBuffer`]s
//!   ([`get_managed_buffer`](GpuMemoryPool::get_managed_buffer),
//!   [`allocate`](GpuMemoryPool::allocate)) and [`BufferBatch`]es
//!   ([`create_buffer_batch`](GpuMemoryPool::create_buffer_batch)), reports [`Stats`], JSON and
//!   [`memory_pressure`](GpuMemoryPool::memory_pressure), trims, limits
//!   ([`set_max_pool_size`](GpuMemoryPool::set_max_pool_size)), gives its cache back
//!   ([`emergency_cleanup`](GpuMemoryPool::emergency_cleanup)) and calls pressure observers.
//! - [`ManagedBuffer`]: an owned block (`element_count()` elements of a [`Precision`]) that
//!   returns itself to the pool, stream-ordered, when dropped.
//! - [`BufferBatch`]: buffers allocated all or nothing ([`BufferRequest`]s), freed together.
//! - [`Device`]: a CUDA ordinal, or a simulated device (`"sim:64MiB"`) whose memory is host
//!   memory — for tests and machines without a GPU.
//! - [`Stream`]: the stream buffers are ordered on; owned (destroyed with its last clone) or
//!   borrowed from another library.
//! - [`GpuError`]: every failure, with its [`ErrorKind`] and the library's message; every fallible
//!   call returns [`Result<T>`](Result) = `std::result::Result<T, GpuError>`.
//! - [`sys`]: the raw declarations, to hand pools and pointers to C code.
//!
//! ```
//! use gpupool::{BufferRequest, Config, Device, ErrorKind, GpuMemoryPool, Precision, Stream};
//!
//! # fn main() -> gpupool::Result<()> {
//! let device = Device::open("sim:64MiB")?;
//! let stream = Stream::new(device)?;
//! let pool = GpuMemoryPool::new(&Config::new())?;
//!
//! let x = pool.get_managed_buffer(device, 250, Precision::Fp32, &stream)?;
//! assert_eq!((x.len(), x.element_count()), (1000, 250));
//! assert_eq!(pool.stats(device)?.live_allocations, 1);
//!
//! drop(x); // returns itself to the pool (ordered on `stream`), kept cached for reuse
//! let again = pool.allocate(device, 1000, &stream)?;
//! assert_eq!(pool.stats(device)?.cache_hits, 1);
//!
//! let batch = pool.create_buffer_batch(
//!     device,
//!     &[BufferRequest::new(1024, Precision::Fp16), BufferRequest::bytes(512)],
//!     &stream,
//! )?;
//! assert_eq!(batch.total_bytes(), 2560);
//! assert!(pool.memory_pressure(device)? > 0.0);
//!
//! let error = pool.get_managed_buffer(device, 0, Precision::Fp32, &stream).unwrap_err();
//! assert_eq!(error.kind(), ErrorKind::InvalidInput);
//!
//! drop((again, batch)); // every buffer returns to the pool's cache
//! assert!(pool.emergency_cleanup(device)? > 0); // the cache goes back to the device
//! assert_eq!(pool.stats(device)?.reserved_bytes, 0);
//! # Ok(())
//! # }
//! ```
#![warn(missing_docs)]

mod batch;
mod buffer;
mod config;
mod device;
mod error;
mod observer;
mod pool;
mod precision;
mod stats;
mod stream;
pub mod sys;

pub use batch::{BufferBatch, BufferRequest};
pub use buffer::ManagedBuffer;
pub use config::Config;
pub use device::Device;
pub use error::{ErrorKind, GpuError, Result};
pub use observer::{ObserverId, PressureObserver};
pub use pool::GpuMemoryPool;
pub use precision::Precision;
pub use stats::Stats;
pub use stream::Stream;

/// Every block is aligned to this many bytes (as `cudaMalloc`'s); larger alignments are refused.
pub const ALIGNMENT: usize = sys::GPUPOOL_ALIGNMENT;

/// "No limit" for byte limits: for [`Config::max_pool_size`] and
/// [`GpuMemoryPool::set_max_pool_size`] the device's memory, for [`Config::max_cached_bytes`] and
/// [`GpuMemoryPool::set_max_cached_bytes`] no cap.
pub const NO_LIMIT: usize = sys::GPUPOOL_NO_LIMIT;
