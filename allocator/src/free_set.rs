//! The free set of one pool: every free mapped block by `(stream, size, address)`, built for
//! rule 6's best fit at the speed of a cache hit.
//!
//! The one rule: it holds exactly the keys a `BTreeSet<FreeKey>` would and yields them in the
//! same order, so what the policy asks of it (the first key at or after `(stream, size, 0)`, the
//! keys after it, the keys below it from the largest down) is what an ordered set answers. Only
//! the layout differs. Per stream, keys fall into size classes ([`class_of`]): exact for sizes
//! below 32 KiB (in 512-byte steps), then eight classes per power of two. A two-level bitmap
//! says which classes hold keys, so the first class at or after a request's is a couple of
//! bit scans; within a class the keys are a sorted vector while few (a binary search and a
//! short shift: the steady state of a training loop, where every class holds a handful), and
//! an ordered set once many blocks share a class (so the cost stays logarithmic when
//! 10⁵ blocks of one size are cached). `tests` checks it against `BTreeSet` on random
//! operations.

use std::collections::BTreeSet;

use crate::backend::StreamId;
use crate::block::{BlockId, FreeKey};

/// A key within one stream: `(size, address, block)`.
type Entry = (u64, u64, BlockId);

/// Sizes below this many 512-byte units have a class of their own.
const EXACT_UNITS: u64 = 64;
/// Classes per power of two above the exact ones (a power of two).
const PER_OCTAVE: u64 = 8;
/// `log2(PER_OCTAVE)`.
const OCTAVE_BITS: u32 = 3;
/// Number of classes: the exact ones, then eight per power of two for unit counts from 2⁶ up
/// to below 2⁵⁵ (a `u64` size has at most 55 bits above the 512-byte unit: 49 powers of two,
/// 2⁶ to 2⁵⁴), so the largest `u64` falls in the last class.
const CLASSES: usize = (EXACT_UNITS + (64 - 9 - 6) * PER_OCTAVE) as usize;
/// Words of the class bitmap.
const WORDS: usize = CLASSES.div_ceil(64);
/// A class's vector becomes an ordered set beyond this many keys, and a set of fewer than
/// half as many becomes a vector again.
const FEW: usize = 32;

/// The size class of `size`: classes are ordered as sizes are (a larger size never has a
/// smaller class), so the keys of classes above a request's class all fit it.
#[inline]
fn class_of(size: u64) -> usize {
    let units = size >> 9;
    if units < EXACT_UNITS {
        return units as usize;
    }
    let e = 63 - units.leading_zeros(); // ≥ 6
    let m = (units >> (e - OCTAVE_BITS)) & (PER_OCTAVE - 1);
    (EXACT_UNITS + u64::from(e - 6) * PER_OCTAVE + m) as usize
}

/// The keys of one size class, in order.
#[derive(Debug, Clone)]
enum Bin {
    Few(Vec<Entry>),
    Many(BTreeSet<Entry>),
}

impl Default for Bin {
    fn default() -> Self {
        Bin::Few(Vec::new())
    }
}

impl Bin {
    fn len(&self) -> usize {
        match self {
            Bin::Few(v) => v.len(),
            Bin::Many(s) => s.len(),
        }
    }

    /// Inserts `e`; whether it was absent.
    fn insert(&mut self, e: Entry) -> bool {
        match self {
            Bin::Few(v) => match v.binary_search(&e) {
                Ok(_) => false,
                Err(i) => {
                    v.insert(i, e);
                    if v.len() > FEW {
                        *self = Bin::Many(std::mem::take(v).into_iter().collect());
                    }
                    true
                }
            },
            Bin::Many(s) => s.insert(e),
        }
    }

    /// Removes `e`; whether it was present.
    fn remove(&mut self, e: &Entry) -> bool {
        match self {
            Bin::Few(v) => match v.binary_search(e) {
                Ok(i) => {
                    v.remove(i);
                    true
                }
                Err(_) => false,
            },
            Bin::Many(s) => {
                let removed = s.remove(e);
                if s.len() < FEW / 2 {
                    *self = Bin::Few(std::mem::take(s).into_iter().collect());
                }
                removed
            }
        }
    }

    fn contains(&self, e: &Entry) -> bool {
        match self {
            Bin::Few(v) => v.binary_search(e).is_ok(),
            Bin::Many(s) => s.contains(e),
        }
    }

    /// Its keys of at least `size` bytes, ascending.
    fn at_least_size(&self, size: u64) -> BinIter<'_> {
        match self {
            Bin::Few(v) => BinIter::Few(v[v.partition_point(|e| e.0 < size)..].iter()),
            Bin::Many(s) => BinIter::Many(s.range((size, 0, 0)..)),
        }
    }

    /// Its keys of fewer than `size` bytes, descending.
    fn below_size(&self, size: u64) -> std::iter::Rev<BinIter<'_>> {
        match self {
            Bin::Few(v) => BinIter::Few(v[..v.partition_point(|e| e.0 < size)].iter()).rev(),
            Bin::Many(s) => BinIter::Many(s.range(..(size, 0, 0))).rev(),
        }
    }
}

/// An iterator over part of one bin.
enum BinIter<'a> {
    Few(std::slice::Iter<'a, Entry>),
    Many(std::collections::btree_set::Range<'a, Entry>),
}

impl<'a> Iterator for BinIter<'a> {
    type Item = &'a Entry;

    #[inline]
    fn next(&mut self) -> Option<&'a Entry> {
        match self {
            BinIter::Few(i) => i.next(),
            BinIter::Many(i) => i.next(),
        }
    }
}

impl DoubleEndedIterator for BinIter<'_> {
    fn next_back(&mut self) -> Option<Self::Item> {
        match self {
            BinIter::Few(i) => i.next_back(),
            BinIter::Many(i) => i.next_back(),
        }
    }
}

/// The free keys of one stream.
#[derive(Debug, Clone)]
struct StreamSet {
    stream: StreamId,
    /// Bit `c % 64` of word `c / 64`: class `c` holds keys.
    words: [u64; WORDS],
    /// Bit `w`: word `w` is not zero.
    summary: u64,
    bins: Box<[Bin]>,
}

impl StreamSet {
    fn new(stream: StreamId) -> Self {
        StreamSet {
            stream,
            words: [0; WORDS],
            summary: 0,
            bins: (0..CLASSES).map(|_| Bin::default()).collect(),
        }
    }

    fn mark(&mut self, c: usize) {
        self.words[c / 64] |= 1 << (c % 64);
        self.summary |= 1 << (c / 64);
    }

    fn unmark(&mut self, c: usize) {
        self.words[c / 64] &= !(1 << (c % 64));
        if self.words[c / 64] == 0 {
            self.summary &= !(1 << (c / 64));
        }
    }

    /// The first class after `c` that holds keys.
    #[inline]
    fn next_class(&self, c: usize) -> Option<usize> {
        let c = c + 1;
        if c >= CLASSES {
            return None;
        }
        let w = c / 64;
        let bits = self.words[w] & (u64::MAX << (c % 64));
        if bits != 0 {
            return Some(w * 64 + bits.trailing_zeros() as usize);
        }
        let above = self.summary & (u64::MAX.checked_shl(w as u32 + 1).unwrap_or(0));
        if above == 0 {
            return None;
        }
        let w = above.trailing_zeros() as usize;
        Some(w * 64 + self.words[w].trailing_zeros() as usize)
    }

    /// The last class before `c` that holds keys.
    fn prev_class(&self, c: usize) -> Option<usize> {
        (0..c)
            .rev()
            .find(|&k| self.words[k / 64] & (1 << (k % 64)) != 0)
    }
}

/// The free set of one pool (see the module's documentation).
#[derive(Debug, Clone, Default)]
pub(crate) struct FreeSet {
    /// By stream, ascending.
    streams: Vec<StreamSet>,
    len: usize,
}

impl FreeSet {
    #[inline]
    fn stream(&self, stream: StreamId) -> Option<&StreamSet> {
        self.streams.iter().find(|s| s.stream == stream)
    }

    /// Number of keys.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Inserts `key`; whether it was absent.
    #[inline]
    pub(crate) fn insert(&mut self, key: FreeKey) -> bool {
        let (stream, size, address, id) = key;
        let i = match self.streams.iter().position(|s| s.stream == stream) {
            Some(i) => i,
            None => {
                let i = self.streams.partition_point(|s| s.stream < stream);
                self.streams.insert(i, StreamSet::new(stream));
                i
            }
        };
        let s = &mut self.streams[i];
        let c = class_of(size);
        if !s.bins[c].insert((size, address, id)) {
            return false;
        }
        s.mark(c);
        self.len += 1;
        true
    }

    /// Removes `key`; whether it was present. A stream's classes stay allocated when it has
    /// no key left (a stream that freed once will again).
    #[inline]
    pub(crate) fn remove(&mut self, key: &FreeKey) -> bool {
        let &(stream, size, address, id) = key;
        let Some(s) = self.streams.iter_mut().find(|s| s.stream == stream) else {
            return false;
        };
        let c = class_of(size);
        if !s.bins[c].remove(&(size, address, id)) {
            return false;
        }
        if s.bins[c].len() == 0 {
            s.unmark(c);
        }
        self.len -= 1;
        true
    }

    /// Whether `key` is in the set.
    pub(crate) fn contains(&self, key: &FreeKey) -> bool {
        let &(stream, size, address, id) = key;
        self.stream(stream)
            .is_some_and(|s| s.bins[class_of(size)].contains(&(size, address, id)))
    }

    /// The keys of `stream` of at least `size` bytes, ascending: what
    /// `BTreeSet::range((stream, size, 0, 0)..)` yields before it reaches another stream.
    #[inline]
    pub(crate) fn at_least(&self, stream: StreamId, size: u64) -> AtLeast<'_> {
        let Some(s) = self.stream(stream) else {
            return AtLeast {
                set: None,
                class: 0,
                inner: BinIter::Few([].iter()),
            };
        };
        let c = class_of(size);
        AtLeast {
            set: Some(s),
            class: c,
            inner: s.bins[c].at_least_size(size),
        }
    }

    /// The keys of `stream` of fewer than `size` bytes, descending: what
    /// `BTreeSet::range(..(stream, size, 0, 0)).rev()` yields before it reaches another
    /// stream.
    pub(crate) fn below(&self, stream: StreamId, size: u64) -> impl Iterator<Item = FreeKey> + '_ {
        let s = self.stream(stream);
        let c = class_of(size);
        let first = s.map(|s| s.bins[c].below_size(size));
        let lower = s.into_iter().flat_map(move |s| {
            std::iter::successors(s.prev_class(c), move |&k| s.prev_class(k))
                .flat_map(move |k| s.bins[k].below_size(u64::MAX))
        });
        first
            .into_iter()
            .flatten()
            .chain(lower)
            .map(move |&(size, address, id)| (stream, size, address, id))
    }

    /// Every key, ascending `(stream, size, address, block)`.
    pub(crate) fn iter(&self) -> impl Iterator<Item = FreeKey> + '_ {
        self.streams.iter().flat_map(|s| self.at_least(s.stream, 0))
    }
}

/// The keys of one stream from a size on, ascending ([`FreeSet::at_least`]).
pub(crate) struct AtLeast<'a> {
    set: Option<&'a StreamSet>,
    class: usize,
    inner: BinIter<'a>,
}

impl Iterator for AtLeast<'_> {
    type Item = FreeKey;

    #[inline]
    fn next(&mut self) -> Option<FreeKey> {
        let s = self.set?;
        loop {
            if let Some(&(size, address, id)) = self.inner.next() {
                return Some((s.stream, size, address, id));
            }
            let Some(c) = s.next_class(self.class) else {
                self.set = None;
                return None;
            };
            self.class = c;
            self.inner = s.bins[c].at_least_size(0);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn is_vector(b: &Bin) -> bool {
        matches!(b, Bin::Few(_))
    }

    /// The two-level bitmap marks exactly the classes that hold keys, and the summary exactly
    /// the words that are not zero (a stale bit would only make searches visit empty classes,
    /// which no answer shows: this is where it is checked).
    fn bitmap_is_exact(set: &FreeSet) -> bool {
        set.streams.iter().all(|s| {
            (0..CLASSES).all(|c| (s.words[c / 64] >> (c % 64) & 1 == 1) == (s.bins[c].len() > 0))
                && (0..WORDS).all(|w| (s.summary >> w & 1 == 1) == (s.words[w] != 0))
        })
    }

    #[test]
    fn the_class_walks_skip_the_classes_without_keys() {
        // `next_class` and `prev_class` answer from the bitmap: the next or previous class
        // that holds keys, never an empty one in between (a walk that stopped at every class
        // would give the same keys, slower).
        let mut set = FreeSet::default();
        let s = StreamId(0);
        let (small, large) = (3 * 512, 1 << 30);
        assert!(set.insert((s, small, 0, 0)));
        assert!(set.insert((s, large, 1 << 40, 1)));
        let st = &set.streams[0];
        let (cs, cl) = (class_of(small), class_of(large));
        assert!(cl > cs + 1);
        assert_eq!(st.next_class(cs), Some(cl));
        assert_eq!(st.next_class(cl), None);
        assert_eq!(st.prev_class(cl), Some(cs));
        assert_eq!(st.prev_class(cs), None);
    }

    #[test]
    fn a_class_is_a_vector_up_to_few_keys_and_a_set_again_only_below_half_as_many() {
        // The layout's promise (module documentation): a sorted vector while a class holds at
        // most FEW keys, an ordered set beyond (logarithmic once 10⁵ blocks share a size),
        // and, with hysteresis so a class at the boundary does not convert on every call, a
        // vector again only once fewer than FEW / 2 remain.
        let mut b = Bin::default();
        let e = |i: u64| (4096, i * 4096, i as BlockId);
        for i in 0..FEW as u64 {
            assert!(b.insert(e(i)));
            assert!(is_vector(&b), "{} keys", i + 1);
        }
        assert!(!b.insert(e(0)), "a key already there");
        assert!(is_vector(&b));
        assert!(b.insert(e(FEW as u64)));
        assert!(!is_vector(&b), "{} keys: a set", FEW + 1);
        // Down to FEW / 2 keys it stays a set ...
        for i in (FEW as u64 / 2..=FEW as u64).rev() {
            assert!(b.remove(&e(i)));
            assert!(!is_vector(&b), "{} keys left", b.len());
        }
        assert_eq!(b.len(), FEW / 2);
        assert!(!b.remove(&e(FEW as u64)), "a key no longer there");
        assert!(!is_vector(&b));
        // ... and one fewer makes it a vector, with the same keys in order.
        assert!(b.remove(&e(FEW as u64 / 2 - 1)));
        assert!(is_vector(&b));
        let left: Vec<Entry> = b.at_least_size(0).copied().collect();
        assert_eq!(left, (0..FEW as u64 / 2 - 1).map(e).collect::<Vec<_>>());
    }

    #[test]
    fn classes_are_ordered_as_sizes_and_in_bounds() {
        let mut sizes: Vec<u64> = (0..70u64).map(|i| i * 512).collect();
        for e in 9..64 {
            for d in [0u64, 1, 511, 512] {
                let base = 1u64 << e;
                sizes.extend([base - d.min(base), base + d, base.saturating_mul(3) / 2]);
            }
        }
        sizes.push(u64::MAX);
        sizes.sort_unstable();
        for w in sizes.windows(2) {
            assert!(class_of(w[0]) <= class_of(w[1]), "{w:?}");
        }
        // The table is exactly as long as a `u64` size needs.
        assert_eq!(class_of(u64::MAX), CLASSES - 1);
        // Exact classes below 32 KiB, in 512-byte steps.
        assert_eq!(class_of(512 * 63), 63);
        assert_eq!(class_of(512 * 63 + 511), 63);
        assert_eq!(class_of(512 * 64), 64);
        assert_ne!(class_of(1 << 20), class_of((1 << 20) + (1 << 17)));
    }

    #[derive(Debug, Clone)]
    enum SetOp {
        Insert(FreeKey),
        Remove(FreeKey),
        AtLeast(StreamId, u64),
        Below(StreamId, u64),
    }

    /// Sizes that share classes, cross class and octave borders, and pile onto one class
    /// (so bins become ordered sets and back).
    fn size() -> impl Strategy<Value = u64> {
        prop_oneof![
            (1u64..80).prop_map(|u| u * 512),
            (1u64..4).prop_map(|u| (1 << 20) + u * 512),
            (0u64..1 << 24),
            Just(512 * 3),
            any::<u64>(),
        ]
    }

    fn key() -> impl Strategy<Value = FreeKey> {
        ((0u32..3), size(), (0u64..200), (0u32..4))
            .prop_map(|(s, size, a, id)| (StreamId(s.into()), size, a * 512, id))
    }

    fn set_op() -> impl Strategy<Value = SetOp> {
        prop_oneof![
            6 => key().prop_map(SetOp::Insert),
            3 => key().prop_map(SetOp::Remove),
            2 => ((0u32..4), size()).prop_map(|(s, z)| SetOp::AtLeast(StreamId(s.into()), z)),
            1 => ((0u32..4), size()).prop_map(|(s, z)| SetOp::Below(StreamId(s.into()), z)),
        ]
    }

    proptest! {
        /// The free set answers every question as `BTreeSet<FreeKey>` does.
        #[test]
        fn free_set_agrees_with_an_ordered_set(ops in prop::collection::vec(set_op(), 1..400)) {
            let mut fast = FreeSet::default();
            let mut reference = BTreeSet::new();
            for op in ops {
                match op {
                    SetOp::Insert(k) => prop_assert_eq!(fast.insert(k), reference.insert(k)),
                    SetOp::Remove(k) => {
                        // Remove a present key half the time.
                        let k = reference.range(k..).next().copied().unwrap_or(k);
                        prop_assert_eq!(fast.remove(&k), reference.remove(&k));
                        prop_assert!(!fast.contains(&k));
                    }
                    SetOp::AtLeast(s, z) => {
                        let got: Vec<_> = fast.at_least(s, z).collect();
                        let want: Vec<_> = reference
                            .range((s, z, 0, 0)..)
                            .take_while(|k| k.0 == s)
                            .copied()
                            .collect();
                        prop_assert_eq!(got, want);
                    }
                    SetOp::Below(s, z) => {
                        let got: Vec<_> = fast.below(s, z).collect();
                        let want: Vec<_> = reference
                            .range(..(s, z, 0, 0))
                            .rev()
                            .take_while(|k| k.0 == s)
                            .copied()
                            .collect();
                        prop_assert_eq!(got, want);
                    }
                }
                prop_assert_eq!(fast.len(), reference.len());
                prop_assert!(bitmap_is_exact(&fast));
            }
            let all: Vec<_> = fast.iter().collect();
            let want: Vec<_> = reference.iter().copied().collect();
            prop_assert_eq!(all, want);
            for k in &reference {
                prop_assert!(fast.contains(k));
            }
        }
    }

    #[test]
    fn many_blocks_of_one_size_become_an_ordered_set_and_back() {
        let mut set = FreeSet::default();
        let s = StreamId(0);
        for a in 0..1000u64 {
            assert!(set.insert((s, 4096, a * 4096, a as u32)));
        }
        let c = class_of(4096);
        assert!(matches!(set.streams[0].bins[c], Bin::Many(_)));
        assert_eq!(set.at_least(s, 4096).next(), Some((s, 4096, 0, 0)));
        for a in 0..995u64 {
            assert!(set.remove(&(s, 4096, a * 4096, a as u32)));
        }
        assert!(matches!(set.streams[0].bins[c], Bin::Few(_)));
        assert_eq!(
            set.at_least(s, 1).map(|k| k.2).collect::<Vec<_>>(),
            (995..1000).map(|a| a * 4096).collect::<Vec<_>>()
        );
    }
}
