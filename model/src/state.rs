//! The model's state — segments tiled by blocks, and the events holding pending blocks — and
//! the public view of it ([`ModelSegment`], [`ModelBlock`]).
//!
//! Under expandable segments (rule 19) a *range* is kept as a [`Segment`] too, marked
//! `expandable`, tiled by mapped blocks (free, allocated or pending), unmapped blocks
//! (`mapped == false`, state `Free`, in no free set) and, under page aliasing (rule 22a),
//! lent blocks (`mapped == false`, `lent == true`: slots mapping pages whose home is
//! elsewhere; state `Free`, in no free set, counted in no statistic). Its public view is
//! built in `expandable.rs` (rule 19h). The pages behind a range's slots are in
//! `aliasing.rs`.

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
    /// Rule 23b: a piece of a range held by a stitched view in use — the bytes of a page that
    /// the view's allocation uses. In no free set, never merged, never handed out; requested
    /// size 0; counted in no statistic of its own (the view's allocation counts).
    Held,
}

/// The public view of one block.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelBlock {
    /// The block's first byte.
    pub address: u64,
    /// The block's size (a multiple of 512).
    pub size: u64,
    /// The size the user asked for, while allocated or pending; 0 for a free or held block.
    pub requested: u64,
    /// Free, allocated, pending or (rule 23b) held.
    pub state: BlockState,
}

/// The public view of one segment: one device allocation, or (rule 19h) one maximal run of
/// mapped blocks in a range of expandable segments.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelSegment {
    /// The address the device returned; for an expandable segment, its first block's address.
    pub address: u64,
    /// The size of the device allocation; for an expandable segment, the sum of its blocks.
    pub size: u64,
    /// The stream every block of the segment belongs to.
    pub stream: u64,
    /// Whether the segment belongs to the small pool.
    pub small: bool,
    /// The blocks tiling the segment, in address order.
    pub blocks: Vec<ModelBlock>,
    /// Whether this is a run of mapped blocks in a range of expandable segments (rule 19h).
    pub expandable: bool,
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
    /// Rule 19: whether memory is mapped behind the block. Always true in a segment; false
    /// for an unmapped block of a range (then the state is `Free`, but the block is in no
    /// free set and is never merged with free blocks).
    pub(crate) mapped: bool,
    /// Rule 22a: whether the block is a lent block — slots that map pages whose home lies
    /// elsewhere (then `mapped` is false: no memory is handed out through it).
    pub(crate) lent: bool,
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
            mapped: true,
            lent: false,
        }
    }

    /// Rule 19: an unmapped block of a range.
    pub(crate) fn unmapped(address: u64, size: u64) -> Block {
        Block {
            mapped: false,
            ..Block::free(address, size, 0)
        }
    }

    /// Rule 22a: a lent block of a range.
    pub(crate) fn lent(address: u64, size: u64) -> Block {
        Block {
            mapped: false,
            lent: true,
            ..Block::free(address, size, 0)
        }
    }

    /// Rule 19: whether the block is unmapped address space (neither mapped nor lent).
    pub(crate) fn is_unmapped(&self) -> bool {
        !self.mapped && !self.lent
    }

    /// Rule 23b: a held piece of `size` bytes at `address`.
    pub(crate) fn held(address: u64, size: u64) -> Block {
        Block {
            state: BlockState::Held,
            ..Block::free(address, size, 0)
        }
    }

    /// Whether the block is in its pool's free set: free and mapped (rules 6, 10, 19).
    pub(crate) fn in_free_set(&self) -> bool {
        self.state == BlockState::Free && self.mapped
    }

    /// The public view of the block.
    pub(crate) fn view(&self) -> ModelBlock {
        ModelBlock {
            address: self.address,
            size: self.size,
            requested: self.requested,
            state: self.state,
        }
    }
}

/// One device allocation, tiled by its blocks in address order; or, when `expandable`, one
/// range of expandable segments (rule 19): reserved address space tiled by mapped and
/// unmapped blocks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Segment {
    pub(crate) address: u64,
    pub(crate) size: u64,
    pub(crate) stream: u64,
    pub(crate) pool: Pool,
    pub(crate) blocks: Vec<Block>,
    /// Rule 19: whether this is a range rather than a device allocation.
    pub(crate) expandable: bool,
}

impl Segment {
    /// Whether the segment is one free block (the only kind of segment that can be given
    /// back to the device).
    pub(crate) fn is_one_free_block(&self) -> bool {
        // Rule 19f: a range is never a whole segment.
        !self.expandable && self.blocks.len() == 1 && self.blocks[0].state == BlockState::Free
    }

    /// The public view of the segment (not of a range: see `expandable.rs`, rule 19h).
    pub(crate) fn view(&self) -> ModelSegment {
        ModelSegment {
            address: self.address,
            size: self.size,
            stream: self.stream,
            small: self.pool == Pool::Small,
            blocks: self.blocks.iter().map(Block::view).collect(),
            expandable: false,
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
    /// Whether the block is a whole segment (never for a block of a range, rule 19f).
    pub(crate) whole: bool,
    /// The block's `free_since`.
    pub(crate) free_since: u64,
    /// Rule 19: whether the block belongs to a range.
    pub(crate) expandable: bool,
    /// Rule 19a: the block's reach — its size plus the size of the block after it when that
    /// one is unmapped.
    pub(crate) reach: u64,
}

impl FreeEntry {
    /// The entry's position key in the free set.
    pub(crate) fn key(&self) -> (u64, u64, u64) {
        (self.stream, self.size, self.address)
    }
}

/// The free set of `pool`: every free block of the pool, sorted by `(stream, size, address)`.
/// Unmapped blocks of ranges are not in it (rule 19).
pub(crate) fn free_set(segments: &[Segment], pool: Pool) -> Vec<FreeEntry> {
    let mut entries = Vec::new();
    for segment in segments.iter().filter(|s| s.pool == pool) {
        for (i, block) in segment.blocks.iter().enumerate() {
            if block.in_free_set() {
                // Rule 19a: the reach counts an unmapped block right after.
                let unmapped_after = match segment.blocks.get(i + 1) {
                    Some(next) if next.is_unmapped() => next.size,
                    _ => 0,
                };
                entries.push(FreeEntry {
                    stream: segment.stream,
                    size: block.size,
                    address: block.address,
                    whole: !segment.expandable && segment.blocks.len() == 1,
                    free_since: block.free_since,
                    expandable: segment.expandable,
                    reach: block.size + unmapped_after,
                });
            }
        }
    }
    entries.sort_by_key(FreeEntry::key);
    entries
}

/// The position (segment index, block index) of the block holding the byte at `address`.
pub(crate) fn block_holding(segments: &[Segment], address: u64) -> Option<(usize, usize)> {
    for (s, segment) in segments.iter().enumerate() {
        for (b, block) in segment.blocks.iter().enumerate() {
            if block.address <= address && address - block.address < block.size {
                return Some((s, b));
            }
        }
    }
    None
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
