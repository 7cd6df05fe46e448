//! The decoded pickle: an arena of nodes, the values that refer to them, and why decoding
//! fails.

use std::hash::{Hash, Hasher};

/// Why decoding failed (the reader adds the file name).
#[derive(Debug)]
pub(crate) enum DecodeError {
    /// Not a pickle, or one using features snapshots never use.
    NotPickle(String),
    /// The input ends early.
    Truncated(String),
    /// Over a [`ReadLimits`](crate::snapshot::ReadLimits) bound.
    TooLarge(String),
    /// Reading the input failed.
    Io(std::io::Error),
}

/// What decoding returns.
pub(crate) type Result<T> = std::result::Result<T, DecodeError>;

/// A decoded value: a scalar inline, or a node of the arena.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Value {
    None,
    Bool(bool),
    Int(i64),
    /// An integer above the 64-bit signed range that fits 64 unsigned bits: PyTorch 2.11
    /// writes 2^64 - 1 as the `line` of a frame whose line is unknown (a `size_t` −1).
    UInt(u64),
    /// An integer outside the 64-bit range (up to 32 bytes wide); no snapshot value is.
    BigInt,
    Float(f64),
    Node(u32),
}

impl PartialEq for Value {
    fn eq(&self, other: &Self) -> bool {
        match (self, other) {
            (Value::None, Value::None) | (Value::BigInt, Value::BigInt) => true,
            (Value::Bool(a), Value::Bool(b)) => a == b,
            (Value::Int(a), Value::Int(b)) => a == b,
            (Value::UInt(a), Value::UInt(b)) => a == b,
            (Value::Float(a), Value::Float(b)) => a.to_bits() == b.to_bits(),
            (Value::Node(a), Value::Node(b)) => a == b,
            _ => false,
        }
    }
}

impl Eq for Value {}

impl Hash for Value {
    fn hash<H: Hasher>(&self, h: &mut H) {
        match *self {
            Value::None => h.write_u8(0),
            Value::Bool(b) => h.write_u8(1 + b as u8),
            Value::Int(i) => {
                h.write_u8(3);
                h.write_i64(i)
            }
            Value::BigInt => h.write_u8(4),
            Value::UInt(u) => {
                h.write_u8(7);
                h.write_u64(u)
            }
            Value::Float(f) => {
                h.write_u8(5);
                h.write_u64(f.to_bits())
            }
            Value::Node(n) => {
                h.write_u8(6);
                h.write_u32(n)
            }
        }
    }
}

/// A node of the arena.
#[derive(Debug)]
pub(crate) enum Node {
    Str(Box<str>),
    /// Bytes (their content is not kept: no snapshot value is bytes).
    Bytes,
    List(Vec<Value>),
    Tuple(Box<[Value]>),
    Dict(Vec<(Value, Value)>),
    /// Hash-consed into an equal, earlier node.
    Forward(u32),
    /// An open list holding, so far, exactly the items of the frozen list it names (so that
    /// the thousands of equal `frames` lists are never stored: a later append copies them).
    SameAs(u32),
}

/// A decoded pickle: the arena and its root value.
pub(crate) struct Pickle {
    nodes: Vec<Node>,
    root: Value,
    stored: u64,
}

impl Pickle {
    /// The pickle of the decoded `nodes` and `root`, `stored` values held.
    pub(super) fn new(nodes: Vec<Node>, root: Value, stored: u64) -> Pickle {
        Pickle {
            nodes,
            root,
            stored,
        }
    }

    /// The value the pickle's `STOP` returned.
    pub(crate) fn root(&self) -> Value {
        self.root
    }

    /// The node `id` (forwards followed).
    pub(crate) fn node(&self, id: u32) -> &Node {
        &self.nodes[self.canonical(id) as usize]
    }

    /// The canonical id of node `id` (forwards followed).
    pub(crate) fn canonical(&self, id: u32) -> u32 {
        match self.nodes[id as usize] {
            Node::Forward(to) | Node::SameAs(to) => to,
            _ => id,
        }
    }

    /// Values held at the end of decoding (nodes, container items, memo slots).
    pub(crate) fn stored_values(&self) -> u64 {
        self.stored
    }

    /// Nodes in the arena (forwards included).
    pub(crate) fn num_nodes(&self) -> usize {
        self.nodes.len()
    }
}
