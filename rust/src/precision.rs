//! [`Precision`]: the element type of a [`ManagedBuffer`](crate::ManagedBuffer), which sets its
//! element size.
use std::fmt;

/// The element type of a buffer, as the seed API names it. It only sets the element size:
/// [`GpuMemoryPool::get_managed_buffer`](crate::GpuMemoryPool::get_managed_buffer) allocates
/// `elements * size_bytes()` bytes.
///
/// ```
/// use gpupool::Precision;
/// assert_eq!(Precision::Fp32.size_bytes(), 4);
/// assert_eq!(Precision::Bf16.to_string(), "bf16");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Precision {
    /// 32-bit float: 4 bytes.
    Fp32,
    /// 16-bit IEEE float: 2 bytes.
    Fp16,
    /// 16-bit brain float: 2 bytes.
    Bf16,
    /// 8-bit integer: 1 byte.
    Int8,
    /// Untyped bytes: 1 byte. What [`GpuMemoryPool::allocate`](crate::GpuMemoryPool::allocate)
    /// gives its buffers.
    Bytes,
}

impl Precision {
    /// Every precision, in declaration order.
    pub const ALL: [Precision; 5] = [
        Precision::Fp32,
        Precision::Fp16,
        Precision::Bf16,
        Precision::Int8,
        Precision::Bytes,
    ];

    /// The bytes one element takes: 4 for `Fp32`, 2 for `Fp16` and `Bf16`, 1 for `Int8` and
    /// `Bytes`.
    pub const fn size_bytes(self) -> usize {
        match self {
            Precision::Fp32 => 4,
            Precision::Fp16 | Precision::Bf16 => 2,
            Precision::Int8 | Precision::Bytes => 1,
        }
    }

    /// The name the library uses: `"fp32"`, `"fp16"`, `"bf16"`, `"int8"`, `"bytes"`.
    pub const fn name(self) -> &'static str {
        match self {
            Precision::Fp32 => "fp32",
            Precision::Fp16 => "fp16",
            Precision::Bf16 => "bf16",
            Precision::Int8 => "int8",
            Precision::Bytes => "bytes",
        }
    }
}

impl fmt::Display for Precision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}
