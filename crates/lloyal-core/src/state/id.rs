//! Branch handles.

/// An opaque, generational branch handle that also names its context: a
/// handle used with another context's branches is refused, never mistaken
/// for one of theirs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BranchId {
    /// Slot index. Slots are reused, and every live branch holds one of at
    /// most `MAX_SEQUENCES` leases, so it fits 16 bits.
    pub(super) index: u16,
    /// The [`Branches`](super::Branches) (one per context) that issued it.
    pub(super) context: u16,
    pub(super) generation: u32,
}

impl BranchId {
    /// Pack into one integer (for bindings).
    pub fn to_bits(self) -> u64 {
        (u64::from(self.generation) << 32) | (u64::from(self.context) << 16) | u64::from(self.index)
    }

    pub fn from_bits(bits: u64) -> Self {
        Self {
            index: bits as u16,
            context: (bits >> 16) as u16,
            generation: (bits >> 32) as u32,
        }
    }
}
