//! A structural pass over a pickle's opcodes, run before `serde-pickle` decodes it.
//!
//! This is not an unpickler: it builds no values. It walks the opcode stream the way the
//! pickle virtual machine would, keeping for every stack item only two numbers — how many values
//! it holds once memo references are expanded, and how deeply it nests — so that it can refuse,
//! before any real decoding happens, the inputs that would make decoding costly or crash:
//!
//! - nesting deeper than [`ReadLimits::max_depth`]: `serde-pickle` converts and drops values
//!   recursively, so a few megabytes of `]` and `a` opcodes would overflow the thread's stack;
//! - more than [`ReadLimits::max_values`] values built (`DUP` and re-memoising copy whole
//!   values), or reached once memo references are expanded (every reference to a memoised
//!   value is decoded as a copy, so nested references expand exponentially);
//! - a length prefix that runs past the end of the input, a missing `STOP`, stack underflow,
//!   references to memo slots never filled;
//! - opcodes no memory snapshot contains: globals and class instances (`GLOBAL`,
//!   `STACK_GLOBAL`, `REDUCE`, `BUILD`, `INST`, `OBJ`, `NEWOBJ`, `NEWOBJ_EX`), persistent ids,
//!   extension codes and out-of-band buffers; integers wider than 32 bytes.
//!
//! Two rules make the expansion count exact rather than a guess, and neither is ever broken by
//! Python's pickler: a memo slot is filled once, and a memoised container is not modified after
//! it has been referenced (Python finishes a container before anything refers to it; only a
//! self-referencing structure, which `serde-pickle` refuses anyway, would do otherwise).

use std::collections::HashMap;

use super::read::ReadLimits;

/// Why the pass refused the input.
#[derive(Debug)]
pub(crate) enum GuardError {
    /// Not a pickle, or not one a snapshot can be.
    NotPickle(String),
    /// The input ends too early.
    Truncated(String),
    /// Over a limit.
    TooLarge(String),
}

/// Widest integer (in bytes, `LONG1`/`LONG4`) and longest text number (`INT`, `LONG`,
/// `FLOAT`) accepted: snapshots hold 64-bit integers and doubles.
const MAX_INT_BYTES: usize = 32;
const MAX_NUMBER_TEXT: usize = 80;

#[derive(Debug, Clone, Copy)]
struct Shape {
    /// Values, memo references expanded (saturating).
    nodes: u64,
    /// Nesting depth (a scalar is 1).
    depth: u32,
}

const SCALAR: Shape = Shape { nodes: 1, depth: 1 };

#[derive(Debug, Clone, Copy)]
enum Item {
    Value(Shape),
    /// A reference to a memo slot (what `serde-pickle` keeps on its stack after memoising).
    Ref(u32),
}

#[derive(Debug)]
struct MemoSlot {
    shape: Shape,
    /// Referenced already (pushed by a get, or consumed into a container).
    used: bool,
}

struct Guard<'a> {
    input: &'a [u8],
    pos: usize,
    limits: &'a ReadLimits,
    stack: Vec<Item>,
    /// Stack lengths at each open MARK.
    marks: Vec<usize>,
    memo: HashMap<u32, MemoSlot>,
    /// Values `serde-pickle` would build while parsing (pushes plus copies).
    built: u64,
}

/// Checks `input` (an uncompressed pickle); `Ok` means decoding it stays within `limits`.
pub(crate) fn check(input: &[u8], limits: &ReadLimits) -> Result<(), GuardError> {
    if input.is_empty() {
        return Err(GuardError::NotPickle("the input is empty".into()));
    }
    Guard {
        input,
        pos: 0,
        limits,
        stack: Vec::new(),
        marks: Vec::new(),
        memo: HashMap::new(),
        built: 0,
    }
    .run()
}

fn not_pickle<T>(msg: impl Into<String>) -> Result<T, GuardError> {
    Err(GuardError::NotPickle(msg.into()))
}

impl Guard<'_> {
    fn run(mut self) -> Result<(), GuardError> {
        loop {
            let at = self.pos;
            let op = self.byte()?;
            match op {
                // framing and protocol
                0x80 => {
                    let proto = self.byte()?;
                    if proto > 5 {
                        return not_pickle(format!(
                            "pickle protocol {proto} (offset {at}) is newer than 5"
                        ));
                    }
                }
                0x95 => {
                    self.take(8)?;
                }
                b'.' => return self.stop(at),

                // stack manipulation
                b'(' => self.marks.push(self.stack.len()),
                b'0' => {
                    if self.stack.len() == self.frame_base() {
                        self.pop_mark(at)?;
                    } else {
                        self.pop(at)?;
                    }
                }
                b'1' => {
                    self.pop_mark(at)?;
                }
                b'2' => {
                    let top = self.top(at)?;
                    let shape = self.resolve(top, at)?;
                    self.charge(shape.nodes)?;
                    self.stack.push(Item::Value(shape));
                }

                // memo
                b'p' => {
                    let id = self.text_id(at)?;
                    self.memoize(id, at)?;
                }
                b'q' => {
                    let id = u32::from(self.byte()?);
                    self.memoize(id, at)?;
                }
                b'r' => {
                    let id = self.u32_le()?;
                    self.memoize(id, at)?;
                }
                0x94 => {
                    let id = u32::try_from(self.memo.len()).unwrap_or(u32::MAX);
                    self.memoize(id, at)?;
                }
                b'g' => {
                    let id = self.text_id(at)?;
                    self.get(id, at)?;
                }
                b'h' => {
                    let id = u32::from(self.byte()?);
                    self.get(id, at)?;
                }
                b'j' => {
                    let id = self.u32_le()?;
                    self.get(id, at)?;
                }

                // scalars
                b'N' | 0x88 | 0x89 => self.push(Item::Value(SCALAR))?,
                b'J' => {
                    self.take(4)?;
                    self.push(Item::Value(SCALAR))?;
                }
                b'K' => {
                    self.take(1)?;
                    self.push(Item::Value(SCALAR))?;
                }
                b'M' => {
                    self.take(2)?;
                    self.push(Item::Value(SCALAR))?;
                }
                b'G' => {
                    self.take(8)?;
                    self.push(Item::Value(SCALAR))?;
                }
                b'I' | b'L' | b'F' => {
                    let line = self.line(at)?;
                    if line.len() > MAX_NUMBER_TEXT {
                        return Err(GuardError::TooLarge(format!(
                            "a {}-character number at offset {at}",
                            line.len()
                        )));
                    }
                    self.push(Item::Value(SCALAR))?;
                }
                0x8a => {
                    let n = usize::from(self.byte()?);
                    self.int_bytes(n, at)?;
                }
                0x8b => {
                    let n = self.i32_len(at)?;
                    self.int_bytes(n, at)?;
                }
                b'S' | b'V' => {
                    self.line(at)?;
                    self.push(Item::Value(SCALAR))?;
                }
                b'U' | b'C' | 0x8c => {
                    let n = usize::from(self.byte()?);
                    self.blob(n, at)?;
                }
                b'T' => {
                    let n = self.i32_len(at)?;
                    self.blob(n, at)?;
                }
                b'X' | b'B' => {
                    let n = self.u32_le()? as usize;
                    self.blob(n, at)?;
                }
                0x8d | 0x8e | 0x96 => {
                    let bytes = self.take(8)?;
                    let n = u64::from_le_bytes(bytes.try_into().unwrap_or([0xff; 8]));
                    let n = usize::try_from(n).unwrap_or(usize::MAX);
                    self.blob(n, at)?;
                }

                // containers
                b')' | b']' | b'}' | 0x8f => self.push(Item::Value(SCALAR))?,
                b't' | b'l' | b'd' | 0x91 => {
                    let shape = self.collect_mark(at)?;
                    self.push(Item::Value(shape))?;
                }
                0x85..=0x87 => {
                    let n = usize::from(op - 0x84);
                    let base = self.frame_base();
                    if self.stack.len() < base + n {
                        return not_pickle(format!("stack underflow at offset {at}"));
                    }
                    let start = self.stack.len() - n;
                    let shape = self.container_of(start, at)?;
                    self.stack.truncate(start);
                    self.push(Item::Value(shape))?;
                }
                b'a' => {
                    let item = self.pop(at)?;
                    let child = self.consume(item, at)?;
                    self.extend_top(child.nodes, child.depth, at)?;
                }
                b's' => {
                    let value = self.pop(at)?;
                    let key = self.pop(at)?;
                    let value = self.consume(value, at)?;
                    let key = self.consume(key, at)?;
                    self.extend_top(
                        key.nodes.saturating_add(value.nodes),
                        key.depth.max(value.depth),
                        at,
                    )?;
                }
                b'e' | b'u' | 0x90 => {
                    let shape = self.collect_mark(at)?;
                    // `shape` counted the container itself; the target already has its own.
                    self.extend_top(shape.nodes - 1, shape.depth - 1, at)?;
                }

                // what no memory snapshot contains
                b'c' | 0x93 | b'R' | b'b' | b'i' | b'o' | 0x81 | 0x92 => {
                    return not_pickle(format!(
                        "opcode {} at offset {at} builds a Python object or refers to a global; \
                         a memory snapshot holds only dicts, lists, tuples, strings and numbers",
                        opname(op)
                    ));
                }
                b'P' | b'Q' | 0x82..=0x84 | 0x97 | 0x98 => {
                    return not_pickle(format!(
                        "opcode {} at offset {at} (persistent ids, extension codes, out-of-band \
                         buffers) is not supported",
                        opname(op)
                    ));
                }
                other => {
                    return not_pickle(format!("unknown opcode 0x{other:02x} at offset {at}"));
                }
            }
        }
    }

    fn stop(&mut self, at: usize) -> Result<(), GuardError> {
        let root = self.pop(at)?;
        let shape = self.consume(root, at)?;
        if shape.nodes > self.limits.max_values {
            return Err(GuardError::TooLarge(format!(
                "the pickle expands to {} values (memo references counted as copies), more than \
                 the limit of {}",
                fmt_nodes(shape.nodes),
                self.limits.max_values
            )));
        }
        if self.pos < self.input.len() {
            return not_pickle(format!(
                "{} bytes after the pickle's STOP opcode at offset {at}",
                self.input.len() - self.pos
            ));
        }
        Ok(())
    }

    // ---- input

    fn byte(&mut self) -> Result<u8, GuardError> {
        match self.input.get(self.pos) {
            Some(&b) => {
                self.pos += 1;
                Ok(b)
            }
            None => Err(GuardError::Truncated(format!(
                "the input ends at byte {} before the pickle's STOP opcode",
                self.input.len()
            ))),
        }
    }

    fn take(&mut self, n: usize) -> Result<&[u8], GuardError> {
        let left = self.input.len() - self.pos;
        if n > left {
            return Err(GuardError::Truncated(format!(
                "at offset {} a {n}-byte field needs more than the {left} bytes left",
                self.pos
            )));
        }
        let s = &self.input[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn u32_le(&mut self) -> Result<u32, GuardError> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn i32_len(&mut self, at: usize) -> Result<usize, GuardError> {
        let n = self.u32_le()? as i32;
        usize::try_from(n).or_else(|_| not_pickle(format!("negative length {n} at offset {at}")))
    }

    fn line(&mut self, at: usize) -> Result<&[u8], GuardError> {
        let rest = &self.input[self.pos..];
        match rest.iter().position(|&b| b == b'\n') {
            Some(n) => {
                self.pos += n + 1;
                Ok(&rest[..n])
            }
            None => Err(GuardError::Truncated(format!(
                "the text argument of the opcode at offset {at} has no end of line"
            ))),
        }
    }

    fn text_id(&mut self, at: usize) -> Result<u32, GuardError> {
        let line = self.line(at)?;
        std::str::from_utf8(line)
            .ok()
            .and_then(|s| s.parse::<u32>().ok())
            .ok_or_else(|| GuardError::NotPickle(format!("bad memo id at offset {at}")))
    }

    fn blob(&mut self, n: usize, _at: usize) -> Result<(), GuardError> {
        self.take(n)?;
        self.push(Item::Value(SCALAR))
    }

    fn int_bytes(&mut self, n: usize, at: usize) -> Result<(), GuardError> {
        if n > MAX_INT_BYTES {
            // Check the length is there at all first, so a cut file reads as truncated.
            self.take(n)?;
            return Err(GuardError::TooLarge(format!(
                "a {n}-byte integer at offset {at}; snapshots hold 64-bit integers"
            )));
        }
        self.blob(n, at)
    }

    // ---- stack

    fn frame_base(&self) -> usize {
        self.marks.last().copied().unwrap_or(0)
    }

    fn charge(&mut self, n: u64) -> Result<(), GuardError> {
        self.built = self.built.saturating_add(n);
        if self.built > self.limits.max_values {
            return Err(GuardError::TooLarge(format!(
                "decoding would build more than {} values",
                self.limits.max_values
            )));
        }
        Ok(())
    }

    fn push(&mut self, item: Item) -> Result<(), GuardError> {
        self.charge(1)?;
        self.stack.push(item);
        Ok(())
    }

    fn pop(&mut self, at: usize) -> Result<Item, GuardError> {
        if self.stack.len() <= self.frame_base() {
            return not_pickle(format!("stack underflow at offset {at}"));
        }
        self.stack
            .pop()
            .ok_or_else(|| GuardError::NotPickle(format!("stack underflow at offset {at}")))
    }

    fn top(&self, at: usize) -> Result<Item, GuardError> {
        if self.stack.len() <= self.frame_base() {
            return not_pickle(format!("stack underflow at offset {at}"));
        }
        self.stack
            .last()
            .copied()
            .ok_or_else(|| GuardError::NotPickle(format!("stack underflow at offset {at}")))
    }

    fn pop_mark(&mut self, at: usize) -> Result<usize, GuardError> {
        let base = self.marks.pop().ok_or_else(|| {
            GuardError::NotPickle(format!("no MARK for the opcode at offset {at}"))
        })?;
        self.stack.truncate(base);
        Ok(base)
    }

    fn resolve(&self, item: Item, at: usize) -> Result<Shape, GuardError> {
        match item {
            Item::Value(shape) => Ok(shape),
            Item::Ref(id) => self.memo.get(&id).map(|slot| slot.shape).ok_or_else(|| {
                GuardError::NotPickle(format!(
                    "memo slot {id} read at offset {at} was never filled"
                ))
            }),
        }
    }

    /// Resolves an item that becomes part of another value (its memo slot counts as used).
    fn consume(&mut self, item: Item, at: usize) -> Result<Shape, GuardError> {
        let shape = self.resolve(item, at)?;
        if let Item::Ref(id) = item
            && let Some(slot) = self.memo.get_mut(&id)
        {
            slot.used = true;
        }
        Ok(shape)
    }

    fn check_depth(&self, depth: u32) -> Result<(), GuardError> {
        if depth > self.limits.max_depth {
            return Err(GuardError::TooLarge(format!(
                "values nest deeper than the limit of {}",
                self.limits.max_depth
            )));
        }
        Ok(())
    }

    /// The shape of a container holding the items `stack[start..]`.
    fn container_of(&mut self, start: usize, at: usize) -> Result<Shape, GuardError> {
        let mut nodes: u64 = 1;
        let mut depth: u32 = 0;
        for i in start..self.stack.len() {
            let item = self.stack[i];
            let child = self.consume(item, at)?;
            nodes = nodes.saturating_add(child.nodes);
            depth = depth.max(child.depth);
        }
        let depth = depth + 1;
        self.check_depth(depth)?;
        Ok(Shape { nodes, depth })
    }

    /// Pops the items above the last MARK and returns the shape of a container of them.
    fn collect_mark(&mut self, at: usize) -> Result<Shape, GuardError> {
        let base = *self.marks.last().ok_or_else(|| {
            GuardError::NotPickle(format!("no MARK for the opcode at offset {at}"))
        })?;
        let shape = self.container_of(base, at)?;
        self.pop_mark(at)?;
        Ok(shape)
    }

    /// Adds `nodes` values nested `child_depth` deep to the container on top of the stack.
    fn extend_top(&mut self, nodes: u64, child_depth: u32, at: usize) -> Result<(), GuardError> {
        let depth_limit = self.limits.max_depth;
        let too_deep = || {
            GuardError::TooLarge(format!(
                "values nest deeper than the limit of {depth_limit}"
            ))
        };
        let top_index = match self.stack.len().checked_sub(1) {
            Some(i) if i >= self.frame_base() => i,
            _ => return not_pickle(format!("stack underflow at offset {at}")),
        };
        let grow = |shape: &mut Shape| -> Result<(), GuardError> {
            shape.nodes = shape.nodes.saturating_add(nodes);
            shape.depth = shape.depth.max(child_depth.saturating_add(1));
            if shape.depth > depth_limit {
                return Err(too_deep());
            }
            Ok(())
        };
        match &mut self.stack[top_index] {
            Item::Value(shape) => grow(shape),
            Item::Ref(id) => {
                let id = *id;
                match self.memo.get_mut(&id) {
                    None => not_pickle(format!(
                        "memo slot {id} modified at offset {at} was never filled"
                    )),
                    Some(slot) if slot.used => not_pickle(format!(
                        "the memoised value in slot {id} is modified at offset {at} after being \
                         referenced (a self-referencing structure?)"
                    )),
                    Some(slot) => grow(&mut slot.shape),
                }
            }
        }
    }

    fn memoize(&mut self, id: u32, at: usize) -> Result<(), GuardError> {
        if self.memo.contains_key(&id) {
            return not_pickle(format!("memo slot {id} filled twice (offset {at})"));
        }
        let item = self.pop(at)?;
        let shape = match item {
            Item::Value(shape) => shape,
            Item::Ref(_) => {
                // serde-pickle memoises a copy of the referenced value
                let shape = self.consume(item, at)?;
                self.charge(shape.nodes)?;
                shape
            }
        };
        self.memo.insert(id, MemoSlot { shape, used: false });
        self.stack.push(Item::Ref(id));
        Ok(())
    }

    fn get(&mut self, id: u32, at: usize) -> Result<(), GuardError> {
        match self.memo.get_mut(&id) {
            Some(slot) => slot.used = true,
            None => {
                return not_pickle(format!(
                    "memo slot {id} read at offset {at} was never filled"
                ));
            }
        }
        self.push(Item::Ref(id))
    }
}

fn fmt_nodes(n: u64) -> String {
    if n == u64::MAX {
        "more than 2^64".to_string()
    } else {
        n.to_string()
    }
}

fn opname(op: u8) -> String {
    let name = match op {
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
        _ => return format!("0x{op:02x}"),
    };
    name.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> ReadLimits {
        ReadLimits {
            max_values: 10_000,
            max_depth: 16,
            ..ReadLimits::default()
        }
    }

    #[test]
    fn accepts_a_small_protocol_4_dict() {
        // pickle.dumps({'a': [1, 2], 'b': 'x'}, protocol=4)
        let p = b"\x80\x04\x95\x17\x00\x00\x00\x00\x00\x00\x00}\x94(\x8c\x01a\x94]\x94(K\x01K\x02e\x8c\x01b\x94\x8c\x01x\x94u.";
        check(p, &limits()).unwrap();
    }

    #[test]
    fn refuses_deep_nesting() {
        let mut p = b"\x80\x04".to_vec();
        p.extend(std::iter::repeat_n(b']', 100));
        p.extend(std::iter::repeat_n(b'a', 99));
        p.push(b'.');
        assert!(matches!(check(&p, &limits()), Err(GuardError::TooLarge(_))));
    }

    #[test]
    fn refuses_memo_expansion() {
        // l0 = [0]; l(i+1) = [li, li, li, li] ... 10 levels: 4^10 values from 50 bytes
        let mut p = b"\x80\x04]\x94K\x00a".to_vec();
        for i in 0..10u8 {
            p.extend_from_slice(b"]\x94(");
            for _ in 0..4 {
                p.extend_from_slice(&[b'h', i]);
            }
            p.push(b'e');
        }
        p.push(b'.');
        match check(&p, &limits()) {
            Err(GuardError::TooLarge(m)) => assert!(m.contains("expands"), "{m}"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn refuses_dup_copies() {
        let mut p = b"\x80\x04](".to_vec();
        for _ in 0..1000 {
            p.extend_from_slice(b"K\x00");
        }
        p.push(b'e');
        p.extend(std::iter::repeat_n(b'2', 100));
        p.push(b'.');
        assert!(matches!(check(&p, &limits()), Err(GuardError::TooLarge(_))));
    }

    #[test]
    fn refuses_modifying_a_referenced_memo() {
        // l = []; memoize; m = [get l]; append to l afterwards
        let p = b"\x80\x04]\x94]h\x00a0h\x00K\x01a.";
        assert!(matches!(check(p, &limits()), Err(GuardError::NotPickle(_))));
    }

    #[test]
    fn truncation_is_reported_as_such() {
        let p = b"\x80\x04\x8c\x05ab";
        assert!(matches!(check(p, &limits()), Err(GuardError::Truncated(_))));
        assert!(matches!(
            check(b"\x80\x04K", &limits()),
            Err(GuardError::Truncated(_))
        ));
        assert!(matches!(
            check(b"\x80\x04N", &limits()),
            Err(GuardError::Truncated(_))
        ));
    }
}
