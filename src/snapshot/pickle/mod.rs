//! A streaming decoder for the part of the pickle format that memory snapshots use.
//!
//! It runs the pickle virtual machine over the input as it is read (in 256 KiB pieces, so the
//! file is never held whole) and builds an *arena*: every string, list, tuple and dict is a
//! node with a `u32` id, and a container holds [`Value`](arena::Value)s — small scalars inline (`None`,
//! booleans, 64-bit integers, floats) and node ids for the rest. A memo slot holds a value too,
//! so a memo reference (`BINGET`) costs one 16-byte value wherever it is used: the memory of a
//! decoded pickle follows its distinct data, not the number of references to it (PyTorch's
//! pickler memoises the frame dicts and strings that thousands of trace entries share).
//!
//! Two rules, never broken by Python's pickler, keep the arena a tree-shaped DAG with final
//! node contents:
//!
//! - a container is *frozen* once it is put into another container (Python finishes a
//!   container before anything refers to it); changing a frozen container is refused, which
//!   also refuses every cycle;
//! - a frozen list or tuple is *hash-consed*: when it is equal to one frozen before, it becomes
//!   a forward to that one and its items are freed. A trace entry's `frames` list is a new list
//!   object for every entry in PyTorch's output, but there are few distinct stacks, so this is
//!   what keeps a 128,897-entry trace with 86 frames per entry to a few thousand stored stacks.
//!
//! Bounds ([`ReadLimits`](crate::snapshot::ReadLimits)): the decoder counts the values it
//! holds (nodes, container items, memo slots, stack items and marks) against `max_values`,
//! nesting against `max_depth` (kept per node as items are added, so no pass recurses), and
//! input bytes against `max_input_bytes`; a length prefix is read in pieces as the data
//! arrives, so a prefix claiming more than the input holds costs nothing. Decoding is one pass,
//! linear in the input. Opcodes no snapshot contains (globals, object construction, persistent
//! ids, extension codes, out-of-band buffers, sets, Python 2 strings) are refused.

//!
//! - `arena`: the decoded pickle ([`Pickle`](arena::Pickle)), its values and nodes;
//! - `input`: the input, read in pieces;
//! - `machine`: the virtual machine ([`decode`](machine::decode)).

pub(crate) mod arena;
mod input;
pub(crate) mod machine;
