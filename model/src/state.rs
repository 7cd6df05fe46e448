//! The model's state — segments tiled by blocks, and the events holding pending blocks — and
//! the public view of it ([`ModelSegment`], [`ModelBlock`]).

use crate::rules::Pool;

/// What a block is doing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockState {
    /// In its pool's free set, reusable by requests on its segment's stream.
    Free,
    /// Handed to the user.
    Allocated,
    /// Freed by the user, but waiting for events recorded on other streams that used it.
    Pending,
}

/// The public view of one block.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelBlock {
    /// The block's first byte.
    pub address: u64,
    /// The block's size (a multiple of 512).
    pub size: u64,
    /// The size the user asked for, while allocated or pending; 0 for a free block.
    pub requested: u64,
    /// Free, allocated or pending.
    pub state: BlockState,
}

/// The public view of one segment (one device allocation).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelSegment {
    /// The address the device returned.
    pub address: u64,
    /// The size of the device allocation.
    pub size: u64,
    /// The stream every block of the segment belongs to.
    pub stream: u64,
    /// Whether the segment belongs to the small pool.
    pub small: bool,
    /// The blocks tiling the segment, in address order.
    pub blocks: Vec<ModelBlock>,
}

/// One block of a segment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Block {
    pub(crate) address: u64,
    pub(crate) size: u64,
    /// The user's size while allocated or pending, else 0.
    pub(crate) requested: u64,
    pub(crate) state: BlockState,
    /// While allocated: the streams other than the segment's that used the block
    /// (`record_stream`), ascending, each once. Empty otherwise.
    pub(crate) stream_uses: Vec<u64>,
    /// While pending: how many of its events are outstanding.
    pub(crate) pending_events: usize,
    /// While free: the pool's search counter when the block entered the free set (rule 12).
    pub(crate) free_since: u64,
}

impl Block {
    /// A free block that entered the free set when the search counter was `free_since`.
    pub(crate) fn free(address: u64, size: u64, free_since: u64) -> Block {
        Block {
            address,
            size,
            requested: 0,
            state: BlockState::Free,
            stream_uses: Vec::new(),
            pending_events: 0,
            free_since,
        }
    }

    /// The public view of the block.
    fn view(&self) -> ModelBlock {
        ModelBlock {
            address: self.address,
            size: self.size,
            requested: self.requested,
            state: self.state,
        }
    }
}

/// One device allocation, tiled by its blocks in address order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Segment {
    pub(crate) address: u64,
    pub(crate) size: u64,
    pub(crate) stream: u64,
    pub(crate) pool: Pool,
    pub(crate) blocks: Vec<Block>,
}

impl Segment {
    /// Whether the segment is one free block (the only kind of segment that can be given
    /// back to the device).
    pub(crate) fn is_one_free_block(&self) -> bool {
        self.blocks.len() == 1 && self.blocks[0].state == BlockState::Free
    }

    /// The public view of the segment.
    pub(crate) fn view(&self) -> ModelSegment {
        ModelSegment {
            address: self.address,
            size: self.size,
            stream: self.stream,
            small: self.pool == Pool::Small,
            blocks: self.blocks.iter().map(Block::view).collect(),
        }
    }
}

/// An event recorded on `stream` when a block it used was freed (rule 15).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Event {
    pub(crate) stream: u64,
    /// The address of the pending block it holds.
    pub(crate) block: u64,
    /// Whether the stream's work up to the event is done (`complete_stream`, or waited on).
    pub(crate) complete: bool,
}

/// One entry of a pool's free set, ordered by `(stream, size, address)` as the allocator
/// orders it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct FreeEntry {
    pub(crate) stream: u64,
    pub(crate) size: u64,
    pub(crate) address: u64,
    /// Whether the block is a whole segment.
    pub(crate) whole: bool,
    /// The block's `free_since`.
    pub(crate) free_since: u64,
}

impl FreeEntry {
    /// The entry's position key in the free set.
    pub(crate) fn key(&self) -> (u64, u64, u64) {
        (self.stream, self.size, self.address)
    }
}

/// The free set of `pool`: every free block of the pool, sorted by `(stream, size, address)`.
pub(crate) fn free_set(segments: &[Segment], pool: Pool) -> Vec<FreeEntry> {
    let mut entries = Vec::new();
    for segment in segments.iter().filter(|s| s.pool == pool) {
        for block in &segment.blocks {
            if block.state == BlockState::Free {
                entries.push(FreeEntry {
                    stream: segment.stream,
                    size: block.size,
                    address: block.address,
                    whole: segment.blocks.len() == 1,
                    free_since: block.free_since,
                });
            }
        }
    }
    entries.sort_by_key(FreeEntry::key);
    entries
}

/// The position (segment index, block index) of the block starting at `address`.
pub(crate) fn find_block(segments: &[Segment], address: u64) -> Option<(usize, usize)> {
    for (s, segment) in segments.iter().enumerate() {
        for (b, block) in segment.blocks.iter().enumerate() {
            if block.address == address {
                return Some((s, b));
            }
        }
    }
    None
}
