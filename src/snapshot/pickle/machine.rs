//! The pickle virtual machine: the opcodes snapshots use, run over the input as it is read
//! into the arena, with the rules that keep it a tree-shaped DAG (frozen containers,
//! hash-consed lists and tuples) and the bounds on values held and nesting.

use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::io::Read;

use super::arena::{DecodeError, Node, Pickle, Result, Value};
use super::input::Input;
use crate::snapshot::limits::ReadLimits;

/// Widest integer (`LONG1`/`LONG4`, bytes) accepted.
const MAX_INT_BYTES: u64 = 32;
/// The read buffer's size.
const BUFFER: usize = 256 << 10;

/// What the decoder's hot paths need of a node, kept apart from its content so that it is
/// compact in the cache.
#[derive(Debug, Clone, Copy)]
struct Meta {
    /// The node itself, or the node it was hash-consed into.
    canon: u32,
    /// Nesting depth, a scalar counting 1 (an empty container 1, a list of ints 2).
    depth: u32,
    frozen: bool,
}

struct Machine<'l> {
    limits: &'l ReadLimits,
    nodes: Vec<Node>,
    meta: Vec<Meta>,
    stack: Vec<Value>,
    marks: Vec<usize>,
    /// Memo slots 0, 1, 2, … (what picklers write).
    memo: Vec<Value>,
    /// Memo slots far beyond the dense ones (an index a pickler would not write).
    sparse_memo: HashMap<u32, Value>,
    /// Values held in the arena (nodes, container items) and the memo.
    stored: u64,
    /// Hash of a frozen list's or tuple's items → the first node frozen with that hash.
    consed: HashMap<u64, u32>,
    text: Vec<u8>,
}

/// Decodes the pickle that `src` holds (already decompressed); `gzip` says whether read
/// errors come from a gzip decoder.
/// `size_hint` (the input's size when known) keeps the read buffer small for small inputs.
pub(crate) fn decode(
    src: impl Read,
    gzip: bool,
    size_hint: Option<usize>,
    limits: &ReadLimits,
) -> Result<Pickle> {
    let capacity = size_hint.map_or(BUFFER, |n| n.clamp(64, BUFFER));
    let mut input = Input::new(src, capacity, limits.max_input_bytes, gzip);
    if input.at_end()? {
        return Err(DecodeError::NotPickle("the input is empty".into()));
    }
    let mut m = Machine {
        limits,
        nodes: Vec::new(),
        meta: Vec::new(),
        stack: Vec::new(),
        marks: Vec::new(),
        memo: Vec::new(),
        sparse_memo: HashMap::new(),
        stored: 0,
        consed: HashMap::new(),
        text: Vec::new(),
    };
    let root = m.run(&mut input)?;
    if !input.at_end()? {
        return Err(DecodeError::NotPickle(format!(
            "bytes after the STOP opcode at byte {}",
            input.offset() - 1
        )));
    }
    let stored = m.stored;
    Ok(Pickle::new(m.nodes, root, stored))
}

fn not_pickle(msg: impl Into<String>) -> DecodeError {
    DecodeError::NotPickle(msg.into())
}

/// Names of the opcodes refused because no snapshot uses them.
fn refused(op: u8) -> Option<&'static str> {
    Some(match op {
        b'c' => "GLOBAL",
        0x93 => "STACK_GLOBAL",
        b'R' => "REDUCE",
        b'b' => "BUILD",
        b'i' => "INST",
        b'o' => "OBJ",
        0x81 => "NEWOBJ",
        0x92 => "NEWOBJ_EX",
        b'P' => "PERSID",
        b'Q' => "BINPERSID",
        0x82 => "EXT1",
        0x83 => "EXT2",
        0x84 => "EXT4",
        0x97 => "NEXT_BUFFER",
        0x98 => "READONLY_BUFFER",
        0x8f => "EMPTY_SET",
        0x90 => "ADDITEMS",
        0x91 => "FROZENSET",
        b'S' => "STRING",
        b'T' => "BINSTRING",
        b'U' => "SHORT_BINSTRING",
        b'V' => "UNICODE",
        _ => return None,
    })
}

impl Machine<'_> {
    fn run<R: Read>(&mut self, input: &mut Input<R>) -> Result<Value> {
        loop {
            let at = input.offset();
            let op = input.byte("the pickle").map_err(|e| match e {
                DecodeError::Truncated(_) => DecodeError::Truncated(format!(
                    "the input ends at byte {at} before the pickle's STOP opcode"
                )),
                e => e,
            })?;
            match op {
                0x80 => {
                    let v = input.byte("PROTO")?;
                    if v > 5 {
                        return Err(not_pickle(format!("unsupported pickle protocol {v}")));
                    }
                }
                0x95 => {
                    input.array::<8>("FRAME")?;
                }
                b'(' => {
                    self.marks.push(self.stack.len());
                    self.check_room(0)?;
                }
                b'.' => {
                    let v = self.pop("STOP")?;
                    if !self.stack.is_empty() || !self.marks.is_empty() {
                        return Err(not_pickle(format!(
                            "{} values and {} marks left on the stack at STOP",
                            self.stack.len(),
                            self.marks.len()
                        )));
                    }
                    return Ok(v);
                }
                b'0' => {
                    let floor = self.marks.last().copied().unwrap_or(0);
                    if self.stack.len() > floor {
                        self.stack.pop();
                    } else if !self.marks.is_empty() {
                        self.marks.pop();
                    } else {
                        return Err(not_pickle("POP on an empty stack"));
                    }
                }
                b'1' => {
                    let mark = self.pop_mark("POP_MARK")?;
                    self.stack.truncate(mark);
                }
                b'2' => {
                    let v = *self
                        .stack
                        .last()
                        .ok_or_else(|| not_pickle("DUP on an empty stack"))?;
                    self.push(v)?;
                }
                b'N' => self.push(Value::None)?,
                0x88 => self.push(Value::Bool(true))?,
                0x89 => self.push(Value::Bool(false))?,
                b'K' => {
                    let v = input.byte("BININT1")?;
                    self.push(Value::Int(v as i64))?
                }
                b'M' => {
                    let v = u16::from_le_bytes(input.array("BININT2")?);
                    self.push(Value::Int(v as i64))?
                }
                b'J' => {
                    let v = i32::from_le_bytes(input.array("BININT")?);
                    self.push(Value::Int(v as i64))?
                }
                0x8a => {
                    let n = input.byte("LONG1")? as u64;
                    let v = self.long(input, n, "LONG1")?;
                    self.push(v)?
                }
                0x8b => {
                    let n = i32::from_le_bytes(input.array("LONG4")?);
                    let n = u64::try_from(n)
                        .map_err(|_| not_pickle(format!("LONG4 with negative length {n}")))?;
                    let v = self.long(input, n, "LONG4")?;
                    self.push(v)?
                }
                b'I' => {
                    input.line(&mut self.text, "INT")?;
                    let v = match &self.text[..] {
                        b"01" => Value::Bool(true),
                        b"00" => Value::Bool(false),
                        t => text_int(t, "INT")?,
                    };
                    self.push(v)?
                }
                b'L' => {
                    input.line(&mut self.text, "LONG")?;
                    let t = self.text.strip_suffix(b"L").unwrap_or(&self.text);
                    let v = text_int(t, "LONG")?;
                    self.push(v)?
                }
                b'F' => {
                    input.line(&mut self.text, "FLOAT")?;
                    let v = std::str::from_utf8(&self.text)
                        .ok()
                        .and_then(|t| t.trim().parse::<f64>().ok())
                        .ok_or_else(|| not_pickle("FLOAT with a malformed number"))?;
                    self.push(Value::Float(v))?
                }
                b'G' => {
                    let v = f64::from_be_bytes(input.array("BINFLOAT")?);
                    self.push(Value::Float(v))?
                }
                0x8c => {
                    let n = input.byte("SHORT_BINUNICODE")? as u64;
                    self.string(input, n, "SHORT_BINUNICODE")?
                }
                b'X' => {
                    let n = u32::from_le_bytes(input.array("BINUNICODE")?) as u64;
                    self.string(input, n, "BINUNICODE")?
                }
                0x8d => {
                    let n = u64::from_le_bytes(input.array("BINUNICODE8")?);
                    self.string(input, n, "BINUNICODE8")?
                }
                b'C' => {
                    let n = input.byte("SHORT_BINBYTES")? as u64;
                    self.bytes(input, n, "SHORT_BINBYTES")?
                }
                b'B' => {
                    let n = u32::from_le_bytes(input.array("BINBYTES")?) as u64;
                    self.bytes(input, n, "BINBYTES")?
                }
                0x8e | 0x96 => {
                    let what = if op == 0x8e {
                        "BINBYTES8"
                    } else {
                        "BYTEARRAY8"
                    };
                    let n = u64::from_le_bytes(input.array(what)?);
                    self.bytes(input, n, what)?
                }
                b'}' => self.new_node(Node::Dict(Vec::new()), 0)?,
                b']' => self.new_node(Node::List(Vec::new()), 0)?,
                b')' => self.new_node(Node::Tuple(Box::new([])), 0)?,
                b'd' => {
                    let mark = self.pop_mark("DICT")?;
                    let id = self.new_node_at(mark, Node::Dict(Vec::new()))?;
                    self.fill_dict(id, mark + 1, "DICT")?;
                }
                b'l' => {
                    let mark = self.pop_mark("LIST")?;
                    let id = self.new_node_at(mark, Node::List(Vec::new()))?;
                    self.fill_list(id, mark + 1, "LIST")?;
                }
                b't' => {
                    let mark = self.pop_mark("TUPLE")?;
                    self.tuple(mark)?;
                }
                0x85..=0x87 => {
                    let n = (op - 0x84) as usize;
                    if self.stack.len() < n + self.marks.last().copied().unwrap_or(0) {
                        return Err(not_pickle(format!("TUPLE{n} on a stack of too few values")));
                    }
                    self.tuple(self.stack.len() - n)?;
                }
                b'a' => {
                    if self.stack.len() < 2 + self.marks.last().copied().unwrap_or(0) {
                        return Err(not_pickle("APPEND on a stack of too few values"));
                    }
                    let target = self.stack[self.stack.len() - 2];
                    let id = self.open(target, "APPEND")?;
                    self.fill_list(id, self.stack.len() - 1, "APPEND")?;
                }
                b'e' => {
                    let mark = self.pop_mark("APPENDS")?;
                    let target = self.below_mark(mark, "APPENDS")?;
                    let id = self.open(target, "APPENDS")?;
                    self.fill_list(id, mark, "APPENDS")?;
                }
                b's' => {
                    if self.stack.len() < 3 + self.marks.last().copied().unwrap_or(0) {
                        return Err(not_pickle("SETITEM on a stack of too few values"));
                    }
                    let target = self.stack[self.stack.len() - 3];
                    let id = self.open(target, "SETITEM")?;
                    self.fill_dict(id, self.stack.len() - 2, "SETITEM")?;
                }
                b'u' => {
                    let mark = self.pop_mark("SETITEMS")?;
                    let target = self.below_mark(mark, "SETITEMS")?;
                    let id = self.open(target, "SETITEMS")?;
                    self.fill_dict(id, mark, "SETITEMS")?;
                }
                0x94 => {
                    let v = self.top("MEMOIZE")?;
                    let idx = self.memo.len() as u64 + self.sparse_memo.len() as u64;
                    let idx = u32::try_from(idx).map_err(|_| not_pickle("memo overflow"))?;
                    self.put(idx, v)?
                }
                b'q' => {
                    let idx = input.byte("BINPUT")? as u32;
                    let v = self.top("BINPUT")?;
                    self.put(idx, v)?
                }
                b'r' => {
                    let idx = u32::from_le_bytes(input.array("LONG_BINPUT")?);
                    let v = self.top("LONG_BINPUT")?;
                    self.put(idx, v)?
                }
                b'p' => {
                    input.line(&mut self.text, "PUT")?;
                    let idx = text_index(&self.text, "PUT")?;
                    let v = self.top("PUT")?;
                    self.put(idx, v)?
                }
                b'h' => {
                    let idx = input.byte("BINGET")? as u32;
                    self.get(idx)?
                }
                b'j' => {
                    let idx = u32::from_le_bytes(input.array("LONG_BINGET")?);
                    self.get(idx)?
                }
                b'g' => {
                    input.line(&mut self.text, "GET")?;
                    let idx = text_index(&self.text, "GET")?;
                    self.get(idx)?
                }
                op => {
                    return Err(not_pickle(match refused(op) {
                        Some(name) => format!(
                            "opcode {name} (0x{op:02x}) at byte {at}: Python objects, sets and \
                             Python 2 strings are not part of any memory snapshot"
                        ),
                        None => format!("unknown opcode 0x{op:02x} at byte {at}"),
                    }));
                }
            }
        }
    }

    fn too_large(&self) -> DecodeError {
        DecodeError::TooLarge(format!(
            "more than {} values stored (ReadLimits::max_values)",
            self.limits.max_values
        ))
    }

    /// Checks that `extra` more values fit, stack and marks included.
    #[inline(always)]
    fn check_room(&self, extra: u64) -> Result<()> {
        let held = self.stored + self.stack.len() as u64 + self.marks.len() as u64 + extra;
        if held > self.limits.max_values {
            return Err(self.too_large());
        }
        Ok(())
    }

    #[inline(always)]
    fn push(&mut self, v: Value) -> Result<()> {
        self.check_room(1)?;
        self.stack.push(v);
        Ok(())
    }

    fn pop(&mut self, what: &str) -> Result<Value> {
        if self.stack.len() <= self.marks.last().copied().unwrap_or(0) {
            return Err(not_pickle(format!("{what} on an empty stack")));
        }
        Ok(self.stack.pop().unwrap_or(Value::None))
    }

    fn top(&self, what: &str) -> Result<Value> {
        if self.stack.len() <= self.marks.last().copied().unwrap_or(0) {
            return Err(not_pickle(format!("{what} on an empty stack")));
        }
        Ok(self.stack[self.stack.len() - 1])
    }

    fn pop_mark(&mut self, what: &str) -> Result<usize> {
        self.marks
            .pop()
            .ok_or_else(|| not_pickle(format!("{what} without a MARK")))
    }

    fn below_mark(&self, mark: usize, what: &str) -> Result<Value> {
        let floor = self.marks.last().copied().unwrap_or(0);
        if mark == 0 || mark - 1 < floor {
            return Err(not_pickle(format!(
                "{what} with no container below its MARK"
            )));
        }
        Ok(self.stack[mark - 1])
    }

    fn new_node(&mut self, node: Node, depth: u32) -> Result<()> {
        self.check_room(2)?;
        if self.nodes.len() >= u32::MAX as usize {
            return Err(self.too_large());
        }
        let id = self.nodes.len() as u32;
        let frozen = matches!(node, Node::Str(_) | Node::Bytes);
        self.nodes.push(node);
        self.meta.push(Meta {
            canon: id,
            depth: depth.max(1),
            frozen,
        });
        self.stored += 1;
        self.stack.push(Value::Node(id));
        Ok(())
    }

    /// A new empty container inserted into the stack at `at` (below the values that fill it).
    fn new_node_at(&mut self, at: usize, node: Node) -> Result<u32> {
        self.new_node(node, 1)?;
        if let Some(v) = self.stack.pop() {
            self.stack.insert(at, v);
        }
        Ok(self.nodes.len() as u32 - 1)
    }

    fn long<R: Read>(&mut self, input: &mut Input<R>, n: u64, what: &str) -> Result<Value> {
        if n > MAX_INT_BYTES {
            return Err(DecodeError::TooLarge(format!(
                "{what}: an integer of {n} bytes (at most {MAX_INT_BYTES} accepted)"
            )));
        }
        input.bytes(n, &mut self.text, what)?;
        let b = &self.text;
        if b.is_empty() {
            return Ok(Value::Int(0));
        }
        let negative = b[b.len() - 1] & 0x80 != 0;
        let fill = if negative { 0xff } else { 0 };
        let mut le = [fill; 8];
        let low = b.len().min(8);
        le[..low].copy_from_slice(&b[..low]);
        let v = i64::from_le_bytes(le);
        // Wider than 8 bytes: fits only if the high bytes merely extend the sign.
        if b.len() > 8 && (b[8..].iter().any(|&x| x != fill) || (v < 0) != negative) {
            // A positive value of 64 unsigned bits (the ninth byte a zero sign byte).
            if !negative && b[8..].iter().all(|&x| x == 0) {
                return Ok(Value::UInt(v as u64));
            }
            return Ok(Value::BigInt);
        }
        Ok(Value::Int(v))
    }

    fn string<R: Read>(&mut self, input: &mut Input<R>, n: u64, what: &str) -> Result<()> {
        let mut buf = std::mem::take(&mut self.text);
        input.bytes(n, &mut buf, what)?;
        let s = std::str::from_utf8(&buf)
            .map_err(|e| not_pickle(format!("{what}: the string is not UTF-8: {e}")))?;
        let node = Node::Str(s.into());
        self.text = buf;
        self.new_node(node, 1)
    }

    fn bytes<R: Read>(&mut self, input: &mut Input<R>, n: u64, what: &str) -> Result<()> {
        input.bytes(n, &mut self.text, what)?;
        self.new_node(Node::Bytes, 1)
    }

    fn put(&mut self, idx: u32, v: Value) -> Result<()> {
        let i = idx as usize;
        if i < self.memo.len() {
            self.memo[i] = v;
        } else if i == self.memo.len() {
            self.check_room(1)?;
            self.memo.push(v);
            self.stored += 1;
        } else {
            self.check_room(1)?;
            if self.sparse_memo.insert(idx, v).is_none() {
                self.stored += 1;
            }
        }
        Ok(())
    }

    #[inline(always)]
    fn get(&mut self, idx: u32) -> Result<()> {
        if let Some(&v) = self.memo.get(idx as usize) {
            return self.push(v);
        }
        match self.sparse_memo.get(&idx) {
            Some(&v) => self.push(v),
            None => Err(not_pickle(format!(
                "memo slot {idx} is read before it is written"
            ))),
        }
    }

    /// The id of the open (not frozen) container `target` that an opcode adds to.
    fn open(&self, target: Value, what: &str) -> Result<u32> {
        let Value::Node(id) = target else {
            return Err(not_pickle(format!(
                "{what} to a value that is not a container"
            )));
        };
        let id = self.meta[id as usize].canon;
        let ok = matches!(
            (&self.nodes[id as usize], what),
            (Node::List(_) | Node::SameAs(_), "APPEND" | "APPENDS")
                | (Node::Dict(_), "SETITEM" | "SETITEMS")
        );
        if !ok {
            return Err(not_pickle(format!("{what} to the wrong kind of value")));
        }
        if self.meta[id as usize].frozen {
            return Err(not_pickle(format!(
                "{what} changes a container after it was put into another one (or into itself)"
            )));
        }
        Ok(id)
    }

    /// Puts `v` into a container: freezes it (hash-consing a list or tuple) and gives the
    /// value to store and its depth.
    #[inline(always)]
    fn adopt(&mut self, v: Value) -> (Value, u32) {
        let Value::Node(id) = v else {
            return (v, 1);
        };
        // A forwarded node is frozen, and its depth is its canonical node's.
        let meta = self.meta[id as usize];
        if meta.frozen {
            return (Value::Node(meta.canon), meta.depth);
        }
        self.freeze(id)
    }

    fn freeze(&mut self, id: u32) -> (Value, u32) {
        let meta = &mut self.meta[id as usize];
        meta.frozen = true;
        let depth = meta.depth;
        let (items, is_list): (&[Value], bool) = match &self.nodes[id as usize] {
            Node::List(items) => (items, true),
            Node::Tuple(items) => (items, false),
            &Node::SameAs(other) => {
                self.nodes[id as usize] = Node::Forward(other);
                self.meta[id as usize].canon = other;
                return (Value::Node(other), depth);
            }
            _ => return (Value::Node(id), depth),
        };
        let key = content_hash(is_list, items);
        match self.consed.get(&key) {
            Some(&other) => {
                let same = match (&self.nodes[other as usize], &self.nodes[id as usize]) {
                    (Node::List(a), Node::List(b)) => a == b,
                    (Node::Tuple(a), Node::Tuple(b)) => a == b,
                    _ => false,
                };
                if same {
                    self.stored -= items.len() as u64;
                    self.nodes[id as usize] = Node::Forward(other);
                    self.meta[id as usize].canon = other;
                    return (Value::Node(other), depth);
                }
            }
            None => {
                self.consed.insert(key, id);
            }
        }
        (Value::Node(id), depth)
    }

    /// Freezes the stack's values from `from` on, giving the deepest of them.
    fn adopt_stack(&mut self, from: usize) -> u32 {
        let mut depth = 0;
        for i in from..self.stack.len() {
            let (v, d) = self.adopt(self.stack[i]);
            self.stack[i] = v;
            depth = depth.max(d);
        }
        depth
    }

    /// Moves the stack's values from `from` on into list `id` (which stays below them).
    fn fill_list(&mut self, id: u32, from: usize, what: &str) -> Result<()> {
        let depth = self.adopt_stack(from);
        self.finish_fill(id, depth, what)?;
        let items = &self.stack[from..];
        match &self.nodes[id as usize] {
            Node::List(list) if list.is_empty() && !items.is_empty() => {
                // Equal to a list frozen before? Then share it until something changes.
                if let Some(&other) = self.consed.get(&content_hash(true, items))
                    && matches!(&self.nodes[other as usize], Node::List(o) if o[..] == *items)
                {
                    self.nodes[id as usize] = Node::SameAs(other);
                    self.stack.truncate(from);
                    return Ok(());
                }
            }
            &Node::SameAs(other) => {
                let copy = match &self.nodes[other as usize] {
                    Node::List(o) => o.clone(),
                    _ => Vec::new(),
                };
                self.stored += copy.len() as u64;
                self.check_room(0)?;
                self.nodes[id as usize] = Node::List(copy);
            }
            _ => {}
        }
        let items = &self.stack[from..];
        if let Node::List(list) = &mut self.nodes[id as usize] {
            if list.is_empty() {
                list.reserve_exact(items.len());
            }
            list.extend_from_slice(items);
        }
        self.stored += items.len() as u64;
        self.stack.truncate(from);
        Ok(())
    }

    /// Moves the stack's key/value pairs from `from` on into dict `id`.
    fn fill_dict(&mut self, id: u32, from: usize, what: &str) -> Result<()> {
        if !(self.stack.len() - from).is_multiple_of(2) {
            return Err(not_pickle(format!("{what} with an odd number of values")));
        }
        let depth = self.adopt_stack(from);
        self.finish_fill(id, depth, what)?;
        let items = &self.stack[from..];
        if let Node::Dict(dict) = &mut self.nodes[id as usize] {
            if dict.is_empty() {
                dict.reserve_exact(items.len() / 2);
            }
            dict.extend(items.chunks_exact(2).map(|p| (p[0], p[1])));
        }
        self.stored += items.len() as u64;
        self.stack.truncate(from);
        Ok(())
    }

    /// Checks that container `id` may take items of depth `items_depth` (the deepest).
    fn finish_fill(&mut self, id: u32, items_depth: u32, what: &str) -> Result<()> {
        let meta = &mut self.meta[id as usize];
        if meta.frozen {
            return Err(not_pickle(format!("{what} puts a container into itself")));
        }
        let depth = meta.depth.max(items_depth.saturating_add(1));
        if depth > self.limits.max_depth {
            return Err(DecodeError::TooLarge(format!(
                "values nest deeper than {} (ReadLimits::max_depth)",
                self.limits.max_depth
            )));
        }
        meta.depth = depth;
        Ok(())
    }

    /// Replaces the stack's values from `from` on by a tuple of them.
    fn tuple(&mut self, from: usize) -> Result<()> {
        let depth = self.adopt_stack(from).saturating_add(1);
        let items: Box<[Value]> = self.stack[from..].into();
        if depth > self.limits.max_depth {
            return Err(DecodeError::TooLarge(format!(
                "values nest deeper than {} (ReadLimits::max_depth)",
                self.limits.max_depth
            )));
        }
        self.stack.truncate(from);
        self.stored += items.len() as u64;
        self.new_node(Node::Tuple(items), depth)
    }
}

/// The hash-consing key of a list's or tuple's items.
fn content_hash(is_list: bool, items: &[Value]) -> u64 {
    let mut h = Fx(is_list as u64);
    items.hash(&mut h);
    h.0
}

fn text_int(t: &[u8], what: &str) -> Result<Value> {
    let s = std::str::from_utf8(t)
        .map_err(|_| not_pickle(format!("{what} with a malformed number")))?
        .trim();
    if let Ok(v) = s.parse::<i64>() {
        return Ok(Value::Int(v));
    }
    if let Ok(v) = s.parse::<u64>() {
        return Ok(Value::UInt(v));
    }
    let digits = s.strip_prefix(['-', '+']).unwrap_or(s);
    if !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()) {
        Ok(Value::BigInt)
    } else {
        Err(not_pickle(format!("{what} with a malformed number")))
    }
}

fn text_index(t: &[u8], what: &str) -> Result<u32> {
    std::str::from_utf8(t)
        .ok()
        .and_then(|s| s.trim().parse::<u32>().ok())
        .ok_or_else(|| not_pickle(format!("{what} with a malformed memo index")))
}

/// A small multiplicative hasher (the hash-consing keys are checked for equality on a hit, so
/// collisions cost only a missed sharing).
struct Fx(u64);

impl Hasher for Fx {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(b as u64);
        }
    }
    fn write_u8(&mut self, i: u8) {
        self.write_u64(i as u64)
    }
    fn write_u32(&mut self, i: u32) {
        self.write_u64(i as u64)
    }
    fn write_i64(&mut self, i: i64) {
        self.write_u64(i as u64)
    }
    fn write_usize(&mut self, i: usize) {
        self.write_u64(i as u64)
    }
    fn write_u64(&mut self, i: u64) {
        self.0 = (self.0.rotate_left(5) ^ i).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
    }
}
