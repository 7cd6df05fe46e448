//! Stack frames, interned: every distinct frame and every distinct stack of a snapshot is
//! stored once, and trace entries, blocks and segments name their stack by a [`StackId`].

use std::collections::HashMap;
use std::fmt;

/// A stack frame as PyTorch records it (a `{'name', 'filename', 'line'}` dict of a `frames`
/// list).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Frame {
    /// The function (C++ frames carry their demangled signature).
    pub name: String,
    /// The source file (`??` for C++ frames without debug information).
    pub filename: String,
    /// The line (0 when unknown).
    pub line: u64,
}

/// Index of a distinct stack in [`Snapshot::frames`](super::Snapshot::frames);
/// [`StackId::EMPTY`] (0) is the empty stack (no frames recorded).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct StackId(pub u32);

impl StackId {
    /// The empty stack, what every table holds first.
    pub const EMPTY: StackId = StackId(0);
}

/// Index of a distinct frame in a [`FrameTable`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct FrameId(pub u32);

/// Every distinct frame and every distinct stack of a snapshot, each stored once.
///
/// Frames and stacks are numbered in the order they were first interned; the reader interns
/// them in the order the snapshot first uses them (segments, their blocks, then the traces), and
/// the writer writes them in that order, so a snapshot read from a file writes back and reads
/// as an equal snapshot. Equality compares the frames and stacks in order, not how the table's
/// indexes are laid out.
#[derive(Clone)]
pub struct FrameTable {
    frames: Vec<Frame>,
    frame_index: HashMap<Frame, FrameId>,
    /// Stack `i` is `stack_frames[stack_starts[i]..stack_starts[i + 1]]`.
    stack_starts: Vec<u32>,
    stack_frames: Vec<FrameId>,
    stack_index: HashMap<Box<[FrameId]>, StackId>,
}

impl Default for FrameTable {
    fn default() -> Self {
        let mut stack_index = HashMap::new();
        stack_index.insert(Box::<[FrameId]>::from([]), StackId::EMPTY);
        FrameTable {
            frames: Vec::new(),
            frame_index: HashMap::new(),
            stack_starts: vec![0, 0],
            stack_frames: Vec::new(),
            stack_index,
        }
    }
}

impl PartialEq for FrameTable {
    fn eq(&self, other: &Self) -> bool {
        self.frames == other.frames
            && self.stack_starts == other.stack_starts
            && self.stack_frames == other.stack_frames
    }
}

impl Eq for FrameTable {}

impl fmt::Debug for FrameTable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let stacks: Vec<&[FrameId]> = (0..self.num_stacks())
            .map(|i| self.stack_frame_ids(StackId(i as u32)))
            .collect();
        f.debug_struct("FrameTable")
            .field("frames", &self.frames)
            .field("stacks", &stacks)
            .finish()
    }
}

impl FrameTable {
    /// Number of distinct frames.
    pub fn num_frames(&self) -> usize {
        self.frames.len()
    }

    /// Number of distinct stacks, the empty stack included (so at least 1).
    pub fn num_stacks(&self) -> usize {
        self.stack_starts.len() - 1
    }

    /// The frame `id`, if this table has it.
    pub fn frame(&self, id: FrameId) -> Option<&Frame> {
        self.frames.get(id.0 as usize)
    }

    /// The frames of stack `id`, innermost first as PyTorch lists them; empty for an id this
    /// table does not have.
    pub fn stack(&self, id: StackId) -> impl ExactSizeIterator<Item = &Frame> + '_ {
        self.stack_frame_ids(id)
            .iter()
            .map(|f| &self.frames[f.0 as usize])
    }

    /// The frame ids of stack `id`; empty for an id this table does not have.
    pub fn stack_frame_ids(&self, id: StackId) -> &[FrameId] {
        let i = id.0 as usize;
        match (self.stack_starts.get(i), self.stack_starts.get(i + 1)) {
            (Some(&a), Some(&b)) => &self.stack_frames[a as usize..b as usize],
            _ => &[],
        }
    }

    /// Whether `id` names a stack of this table.
    pub fn contains(&self, id: StackId) -> bool {
        (id.0 as usize) < self.num_stacks()
    }

    /// The id of `frame`, adding it if it is new.
    pub fn intern_frame(&mut self, frame: Frame) -> FrameId {
        if let Some(&id) = self.frame_index.get(&frame) {
            return id;
        }
        let id = FrameId(self.frames.len() as u32);
        self.frames.push(frame.clone());
        self.frame_index.insert(frame, id);
        id
    }

    /// The id of the stack of `frames` (innermost first), adding it and its new frames if it
    /// is new. No frames gives [`StackId::EMPTY`].
    pub fn intern_stack(&mut self, frames: impl IntoIterator<Item = Frame>) -> StackId {
        let ids: Vec<FrameId> = frames.into_iter().map(|f| self.intern_frame(f)).collect();
        self.intern_stack_ids(&ids)
    }

    /// The id of the stack of frames `ids` (ids this table gave), adding it if it is new.
    ///
    /// # Panics
    ///
    /// If an id is not one of this table's frames.
    pub fn intern_stack_ids(&mut self, ids: &[FrameId]) -> StackId {
        if let Some(&id) = self.stack_index.get(ids) {
            return id;
        }
        assert!(
            ids.iter().all(|f| (f.0 as usize) < self.frames.len()),
            "a frame id from another table"
        );
        let id = StackId(self.num_stacks() as u32);
        self.stack_frames.extend_from_slice(ids);
        self.stack_starts.push(self.stack_frames.len() as u32);
        self.stack_index.insert(ids.into(), id);
        id
    }
}
