//! Blocks: the slab that holds every block of every segment, linked to its neighbours; the keys
//! of the pools' free and unmapped sets; and the ranges of expandable segments the blocks of a
//! range belong to.
//!
//! The one rule: a block id names one slot of the slab for the life of the block; a slot is
//! reused only after the block is gone from every index (free set, live map, event queue).

use crate::backend::StreamId;
use crate::sizes::Pool;

/// The index of a block in the [`Slab`].
pub(crate) type BlockId = u32;

/// A key of a pool's free set, ordered `(stream, size, address)`: best fit is the first key at
/// or after `(stream, size, 0)`.
pub(crate) type FreeKey = (StreamId, u64, u64, BlockId);

/// A key of a pool's unmapped set (rule 19): `(stream, address, block)`.
pub(crate) type UnmappedKey = (StreamId, u64, BlockId);

/// A range of address space for expandable segments (rule 19), which its blocks tile: the
/// blocks name it by its first address ([`Block::range`]).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Range {
    /// Its size in bytes (whole pages).
    pub size: u64,
    /// Its page: 2 MiB in the small pool, 20 MiB in the large pool.
    pub page: u64,
}

/// What a block is doing: allocated, pending, free or held
/// ([`BlockInfo::state`](crate::BlockInfo::state)). In a PyTorch snapshot the first three are
/// `snapshot::BlockStatus`'s `active_allocated`, `active_pending_free` and `inactive`; a held
/// block is memory in use, `active_allocated`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub enum BlockPhase {
    /// In its pool's free set: reusable on its stream.
    Free,
    /// Handed out to the user.
    Allocated,
    /// Freed by the user, waiting for other streams' work (events) before it can be reused.
    Pending,
    /// Held by a stitched view in use (rule 23b); listed with requested size 0.
    Held,
}

/// What backs a block's addresses. Only a block of a range (rule 19) can be other than
/// `Mapped`; an unmapped or lent block is `Free` and in no free set.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Backing {
    /// Memory of its own: a block of a segment, or of a range whose slots are the homes of
    /// their pages (rules 19, 22a). Free, allocated or pending.
    Mapped,
    /// No memory (rule 19): in its pool's unmapped set.
    Unmapped,
    /// Slots that map pages whose homes are elsewhere (rule 22a): in its pool's lent sets,
    /// never handed out as it is.
    Lent,
    /// An allocation through a stitched view (rule 23d): the view's first `size` bytes, in no
    /// segment or range (no neighbours), allocated or pending; its memory is the view's held
    /// pieces at their homes.
    View,
}

/// One block of device memory inside a segment.
#[derive(Clone, Debug)]
pub(crate) struct Block {
    pub address: u64,
    pub size: u64,
    pub requested: u64,
    pub stream: StreamId,
    pub pool: Pool,
    pub prev: Option<BlockId>,
    pub next: Option<BlockId>,
    pub state: BlockPhase,
    /// Outstanding events before a pending block returns to the pool.
    pub event_count: u32,
    /// Streams other than `stream` that used the block while it was allocated.
    pub stream_uses: Vec<StreamId>,
    /// The pool's search counter when the block entered the free set (garbage collection age).
    pub gc_base: u64,
    /// What backs the block: its own memory, none (rule 19: then `Free`, in its pool's
    /// unmapped set and in no other index) or pages lent from elsewhere (rule 22: then `Free`,
    /// in its pool's lent sets and in no other index).
    pub backing: Backing,
    /// The first address of the range (rule 19) the block belongs to, or `None` for a block
    /// of a segment (rule 8, rule 18).
    pub range: Option<u64>,
}

impl Block {
    /// A free, mapped block with no neighbours yet, as every new block starts (a new segment,
    /// the rest of a split, a piece of a range); callers set the links and the rest with
    /// struct-update syntax.
    pub fn free(
        address: u64,
        size: u64,
        stream: StreamId,
        pool: Pool,
        gc_base: u64,
        range: Option<u64>,
    ) -> Block {
        Block {
            address,
            size,
            requested: 0,
            stream,
            pool,
            prev: None,
            next: None,
            state: BlockPhase::Free,
            event_count: 0,
            stream_uses: Vec::new(),
            gc_base,
            backing: Backing::Mapped,
            range,
        }
    }

    /// Whether the block has memory of its own (rules 19, 22a).
    #[inline]
    pub fn mapped(&self) -> bool {
        self.backing == Backing::Mapped
    }

    /// Whether the block is free and has memory of its own: in its pool's free set.
    #[inline]
    pub fn free_mapped(&self) -> bool {
        self.state == BlockPhase::Free && self.backing == Backing::Mapped
    }

    /// Whether the block's segment holds other blocks too.
    #[inline]
    pub fn is_split(&self) -> bool {
        self.prev.is_some() || self.next.is_some()
    }
}

/// Storage for blocks with stable ids and slot reuse.
#[derive(Debug, Default)]
pub(crate) struct Slab {
    slots: Vec<Option<Block>>,
    vacant: Vec<BlockId>,
}

impl Slab {
    pub fn insert(&mut self, block: Block) -> BlockId {
        if let Some(id) = self.vacant.pop() {
            self.slots[id as usize] = Some(block);
            id
        } else {
            self.slots.push(Some(block));
            (self.slots.len() - 1) as BlockId
        }
    }

    pub fn remove(&mut self, id: BlockId) -> Block {
        let block = self.slots[id as usize]
            .take()
            .expect("removing a vacant block slot");
        self.vacant.push(id);
        block
    }

    #[inline]
    pub fn get(&self, id: BlockId) -> &Block {
        self.slots[id as usize].as_ref().expect("vacant block slot")
    }

    /// The block `id`, or `None` for a vacant slot (for the invariant checker).
    pub fn try_get(&self, id: BlockId) -> Option<&Block> {
        self.slots.get(id as usize).and_then(Option::as_ref)
    }

    #[inline]
    pub fn get_mut(&mut self, id: BlockId) -> &mut Block {
        self.slots[id as usize].as_mut().expect("vacant block slot")
    }

    pub fn iter(&self) -> impl Iterator<Item = (BlockId, &Block)> {
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(i, b)| b.as_ref().map(|b| (i as BlockId, b)))
    }

    pub fn len(&self) -> usize {
        self.slots.len() - self.vacant.len()
    }
}
