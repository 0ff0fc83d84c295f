//! [`BufferBatch`]: buffers allocated all or nothing, returned to their pool together.
use std::fmt;
use std::slice;
use std::vec;

use crate::buffer::ManagedBuffer;
use crate::precision::Precision;

/// One buffer of a batch request
/// ([`GpuMemoryPool::create_buffer_batch`](crate::GpuMemoryPool::create_buffer_batch)):
/// `elements` of `precision`, i.e. `elements * precision.size_bytes()` bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BufferRequest {
    /// How many elements (at least 1).
    pub elements: usize,
    /// Their type, which sets the element size.
    pub precision: Precision,
}

impl BufferRequest {
    /// `elements` of `precision`.
    pub const fn new(elements: usize, precision: Precision) -> BufferRequest {
        BufferRequest { elements, precision }
    }

    /// `bytes` untyped bytes ([`Precision::Bytes`]).
    pub const fn bytes(bytes: usize) -> BufferRequest {
        BufferRequest::new(bytes, Precision::Bytes)
    }

    /// The bytes the request asks for; `None` if that overflows `usize`.
    pub const fn size_bytes(&self) -> Option<usize> {
        self.elements.checked_mul(self.precision.size_bytes())
    }
}

impl From<(usize, Precision)> for BufferRequest {
    /// `(elements, precision)`.
    fn from((elements, precision): (usize, Precision)) -> BufferRequest {
        BufferRequest::new(elements, precision)
    }
}

/// Buffers owned together, in order: what
/// [`GpuMemoryPool::create_buffer_batch`](crate::GpuMemoryPool::create_buffer_batch) returns
/// (all requests allocated, or none), or an empty batch filled with [`BufferBatch::push`].
///
/// Dropping the batch returns every buffer it still holds to its pool, each as its own
/// [`ManagedBuffer`] would (ordered on its free stream). [`BufferBatch::remove`] hands a buffer
/// out of the batch, to live on after it.
#[derive(Default)]
pub struct BufferBatch {
    buffers: Vec<ManagedBuffer>,
}

impl BufferBatch {
    /// An empty batch.
    pub fn new() -> BufferBatch {
        BufferBatch::default()
    }

    pub(crate) fn with_capacity(capacity: usize) -> BufferBatch {
        BufferBatch {
            buffers: Vec::with_capacity(capacity),
        }
    }

    /// How many buffers the batch holds.
    pub fn len(&self) -> usize {
        self.buffers.len()
    }

    /// Whether the batch holds no buffer.
    pub fn is_empty(&self) -> bool {
        self.buffers.is_empty()
    }

    /// Buffer `index` (in request or push order); `None` past the end.
    pub fn get(&self, index: usize) -> Option<&ManagedBuffer> {
        self.buffers.get(index)
    }

    /// Buffer `index`, mutably (to [`free_on`](ManagedBuffer::free_on) or
    /// [`record_stream`](ManagedBuffer::record_stream)); `None` past the end.
    pub fn get_mut(&mut self, index: usize) -> Option<&mut ManagedBuffer> {
        self.buffers.get_mut(index)
    }

    /// The buffers, in order.
    pub fn iter(&self) -> slice::Iter<'_, ManagedBuffer> {
        self.buffers.iter()
    }

    /// The buffers, in order, mutably.
    pub fn iter_mut(&mut self) -> slice::IterMut<'_, ManagedBuffer> {
        self.buffers.iter_mut()
    }

    /// Appends `buffer`: the batch owns it now (of any pool or device).
    pub fn push(&mut self, buffer: ManagedBuffer) {
        self.buffers.push(buffer);
    }

    /// Takes buffer `index` out of the batch and hands its ownership to the caller: it is no
    /// longer freed with the batch. Later buffers move down one index. `None` past the end.
    pub fn remove(&mut self, index: usize) -> Option<ManagedBuffer> {
        (index < self.buffers.len()).then(|| self.buffers.remove(index))
    }

    /// The bytes the buffers asked for, summed ([`ManagedBuffer::len`]).
    pub fn total_bytes(&self) -> usize {
        self.buffers.iter().map(ManagedBuffer::len).sum()
    }

    /// Hands every buffer out, in order: the caller owns them now.
    pub fn into_vec(self) -> Vec<ManagedBuffer> {
        self.buffers
    }
}

impl IntoIterator for BufferBatch {
    type Item = ManagedBuffer;
    type IntoIter = vec::IntoIter<ManagedBuffer>;

    /// Hands every buffer out, in order.
    fn into_iter(self) -> Self::IntoIter {
        self.buffers.into_iter()
    }
}

impl<'a> IntoIterator for &'a BufferBatch {
    type Item = &'a ManagedBuffer;
    type IntoIter = slice::Iter<'a, ManagedBuffer>;

    fn into_iter(self) -> Self::IntoIter {
        self.buffers.iter()
    }
}

impl Extend<ManagedBuffer> for BufferBatch {
    fn extend<I: IntoIterator<Item = ManagedBuffer>>(&mut self, buffers: I) {
        self.buffers.extend(buffers);
    }
}

impl FromIterator<ManagedBuffer> for BufferBatch {
    fn from_iter<I: IntoIterator<Item = ManagedBuffer>>(buffers: I) -> BufferBatch {
        BufferBatch {
            buffers: buffers.into_iter().collect(),
        }
    }
}

impl fmt::Debug for BufferBatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(&self.buffers).finish()
    }
}
