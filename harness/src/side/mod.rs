//! The sides the driver compares: one interface over the allocator core, the thread-safe front
//! end on worker threads, and the reference model.
//!
//! The one rule: a side is reached only through [`Side`] — concrete [`Call`]s in, [`Outcome`]s
//! and an [`Observation`] out, in plain numbers. Every call the harness makes into `cachalot`
//! or `cachalot-model` is in this module's three implementations ([`CoreSide`],
//! [`ThreadedSide`], [`ModelSide`]), with the conversions of settings, layouts and errors; a new
//! operation is a [`Call`] variant and one arm in each.

mod core;
mod model;
pub mod quick;
mod threads;

pub use self::core::{CoreSide, FaultKind, adoption_from_allocator, adoption_from_allocator_range};
pub use self::model::{ModelSide, model_config};
pub use self::threads::ThreadedSide;

/// One concrete call on a side: addresses and streams resolved, thread named.
///
/// `thread` says which thread makes the call; a side without threads (the core, the model
/// without rule 17) makes every call on its one thread.
#[derive(Clone, Debug, PartialEq)]
pub enum Call {
    /// Allocate `size` bytes on `stream`.
    Malloc {
        /// The calling thread.
        thread: u8,
        /// Bytes requested.
        size: u64,
        /// The stream.
        stream: u64,
    },
    /// Free the allocation at `address`.
    Free {
        /// The calling thread.
        thread: u8,
        /// The address.
        address: u64,
    },
    /// Record that `stream` uses the allocation at `address`.
    RecordStream {
        /// The calling thread.
        thread: u8,
        /// The address.
        address: u64,
        /// The stream.
        stream: u64,
    },
    /// The work queued on `stream` so far completes (the device's events).
    CompleteStream {
        /// The stream.
        stream: u64,
    },
    /// Release every cached whole segment.
    EmptyCache {
        /// The calling thread.
        thread: u8,
    },
    /// Cap reserved memory at `fraction` of the device.
    SetFraction {
        /// The calling thread.
        thread: u8,
        /// The fraction (invalid ones included).
        fraction: f64,
    },
    /// The next `n` device allocations report out-of-memory.
    FailDeviceAllocs {
        /// How many.
        n: u32,
    },
    /// Adopt a segment the device already holds (rule 18), or a range of expandable
    /// segments (rule 18f) when the adoption says so.
    Adopt {
        /// The segment.
        segment: Adoption,
    },
    /// The next successful device allocation takes this address if usable.
    SetNextAddress {
        /// The address, or `None` to clear it.
        address: Option<u64>,
    },
    /// Put the run-time settings in force (rule 24): the other settings stay.
    SetRuntimeSettings {
        /// `max_split_size` in bytes (`u64::MAX`: none).
        max_split_size: u64,
        /// `max_non_split_rounding_size` in bytes.
        max_non_split_rounding_size: u64,
        /// `garbage_collection_threshold` (0: off).
        garbage_collection_threshold: f64,
        /// `roundup_power2_divisions`, per interval.
        roundup_power2_divisions: [u64; 16],
    },
    /// Give back the free whole segments of `stream` (rule 25).
    ReleaseStream {
        /// The stream.
        stream: u64,
    },
    /// `thread` frees the blocks its cache keeps (rule 17d).
    FlushThread {
        /// The thread.
        thread: u8,
    },
    /// `thread` exits (rule 17e); a fresh thread takes its index.
    RetireThread {
        /// The thread.
        thread: u8,
    },
}

/// What a call gave, in a form both sides can be compared on.
#[derive(Clone, Debug, PartialEq)]
pub enum Outcome {
    /// Success, with the address for an allocation (0 otherwise).
    Ok(u64),
    /// Out of memory, with the figures of the message.
    OutOfMemory {
        /// Segment size tried.
        alloc_size: u64,
        /// Device capacity.
        capacity: u64,
        /// Device free memory.
        device_free: u64,
        /// The memory-fraction limit.
        allowed: Option<u64>,
        /// Bytes allocated.
        allocated: u64,
        /// Bytes reserved but not allocated.
        reserved_unallocated: u64,
    },
    /// Above the largest request served.
    TooLarge,
    /// Not a live allocation.
    UnknownPointer,
    /// A memory fraction outside [0, 1].
    InvalidFraction,
    /// A setting the call may not change (rule 24).
    Unsupported,
    /// A segment to adopt that fails rule 18a's checks.
    InvalidAdoption,
    /// A segment to adopt that the device has no room for (rule 18b).
    AdoptionOutOfMemory,
    /// A device failure injected by the test (only the core's fault harness injects them).
    InjectedFault,
    /// Any other error (a harness bug if it ever appears on one side only).
    Other(String),
}

/// A segment to adopt, in plain numbers both sides convert to their own type.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Adoption {
    /// The segment's address.
    pub address: u64,
    /// The segment's size (for a range: unused, the range's size is rule 19's).
    pub size: u64,
    /// The segment's stream.
    pub stream: u64,
    /// Small pool (else large).
    pub small: bool,
    /// The blocks in address order.
    pub blocks: Vec<AdoptionBlock>,
    /// A range of expandable segments (rule 18f: the blocks cover its first bytes, the rest
    /// is unmapped), not a segment (rule 18).
    pub range: bool,
}

/// One block of an [`Adoption`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AdoptionBlock {
    /// The block's size.
    pub size: u64,
    /// What it is doing.
    pub state: AdoptionState,
}

/// What an adopted block is doing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AdoptionState {
    /// Cached.
    Free,
    /// Held by the user.
    Allocated {
        /// Bytes requested.
        requested: u64,
    },
    /// Freed, waiting for other streams.
    Pending {
        /// Bytes requested.
        requested: u64,
        /// The streams it waits for.
        streams: Vec<u64>,
    },
    /// Address space of a range with nothing mapped (rule 18f).
    Unmapped,
}

impl Adoption {
    /// The allocated blocks as `(address, requested)`: live allocations once adopted.
    pub fn allocated(&self) -> Vec<(u64, u64)> {
        let mut address = self.address;
        let mut out = Vec::new();
        for b in &self.blocks {
            if let AdoptionState::Allocated { requested } = b.state {
                out.push((address, requested));
            }
            address = address.wrapping_add(b.size);
        }
        out
    }
}

/// A block's state in a [`SegmentView`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockKind {
    /// Cached in its pool.
    Free,
    /// Held by the user (or parked in a thread cache).
    Allocated,
    /// Freed, waiting for other streams' work.
    Pending,
    /// Held by a stitched view in use (rule 23b).
    Held,
}

/// One block as a side reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockView {
    /// Address.
    pub address: u64,
    /// Size.
    pub size: u64,
    /// Bytes requested (0 for a free block).
    pub requested: u64,
    /// State.
    pub kind: BlockKind,
}

/// One segment as a side reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SegmentView {
    /// Address.
    pub address: u64,
    /// Size.
    pub size: u64,
    /// Stream.
    pub stream: u64,
    /// Small pool (else large).
    pub small: bool,
    /// A run of mapped memory in an expandable segment's range (rule 19h).
    pub expandable: bool,
    /// Blocks in address order.
    pub blocks: Vec<BlockView>,
}

/// Every statistic, flattened: `(field, value)` in serialisation order, with markers around
/// each nested struct (see [`flatten_stats`]). The names and the numbers are kept apart, the
/// names as one list shared by every flattening of the same type (interned: the same strings
/// in the same order are the same list), so that comparing two of them is comparing two lists
/// of numbers and, once per pair of name lists, the names.
#[derive(Clone, Debug)]
pub struct FlatStats {
    names: &'static [&'static str],
    values: Vec<i128>,
}

impl FlatStats {
    /// Statistics from `(field, value)` pairs, in order.
    pub fn from_pairs(pairs: &[(&'static str, i128)]) -> FlatStats {
        let keys: Vec<NameKey> = pairs.iter().map(|p| name_key(p.0)).collect();
        FlatStats {
            names: intern(&keys, || pairs.iter().map(|p| p.0).collect()),
            values: pairs.iter().map(|p| p.1).collect(),
        }
    }

    /// The `(field, value)` pairs, in serialisation order.
    pub fn iter(&self) -> impl Iterator<Item = (&'static str, i128)> + '_ {
        self.names.iter().copied().zip(self.values.iter().copied())
    }

    /// How many pairs (markers included).
    pub fn len(&self) -> usize {
        self.values.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.values.is_empty()
    }
}

/// Equal numbers under equal names, in the same order: [`same_stats`].
impl PartialEq for FlatStats {
    fn eq(&self, other: &FlatStats) -> bool {
        same_stats(self, other)
    }
}

/// A field name by its address and length: equal keys are the very same string (the names of a
/// type's `Serialize` impl are the same `&'static str`s every time), and a list of keys
/// compares as one block of memory.
type NameKey = [usize; 2];

fn name_key(name: &'static str) -> NameKey {
    [name.as_ptr() as usize, name.len()]
}

/// The one shared copy of the list of field names whose keys are `keys`: the list interned
/// before, or `names()` interned now. Lists are never freed (there is one per type flattened,
/// and one per list a test makes up).
fn intern(keys: &[NameKey], names: impl FnOnce() -> Vec<&'static str>) -> &'static [&'static str] {
    type Interned = (Vec<NameKey>, &'static [&'static str]);
    thread_local! {
        static INTERNED: std::cell::RefCell<Vec<Interned>> =
            const { std::cell::RefCell::new(Vec::new()) };
    }
    INTERNED.with_borrow_mut(|lists| {
        if let Some((_, l)) = lists.iter().find(|(k, _)| k[..] == *keys) {
            return *l;
        }
        let names = names();
        assert!(
            names.iter().map(|n| name_key(n)).eq(keys.iter().copied()),
            "the names walked twice differ"
        );
        let l: &'static [&'static str] = Box::leak(names.into_boxed_slice());
        lists.push((keys.to_vec(), l));
        l
    })
}

/// Everything a user can observe of a side, in a form both sides share.
#[derive(Clone, Debug, PartialEq)]
pub struct Observation {
    /// Every statistic.
    pub stats: FlatStats,
    /// Every segment and block, by address.
    pub layout: Vec<SegmentView>,
    /// Bytes the device has handed out.
    pub device_used: u64,
    /// Blocks parked in thread caches.
    pub thread_cached_blocks: usize,
    /// Rule 23k: how many stream waits the device has logged, and the last
    /// [`STREAM_WAITS_TAIL`] of them, `(waiter, on)`, in order. Compared after every step, a
    /// step making at most that many waits is compared wait for wait.
    pub stream_waits: (usize, Vec<(u64, u64)>),
}

/// How many of the latest stream waits an [`Observation`] holds.
pub const STREAM_WAITS_TAIL: usize = 64;

/// Rule 23k: a device's stream waits as an [`Observation`] holds them: how many were made in
/// all (`count`), and the last [`STREAM_WAITS_TAIL`] of `latest` (the latest ones, in order).
pub fn stream_waits_observed(
    count: usize,
    latest: impl ExactSizeIterator<Item = (u64, u64)>,
) -> (usize, Vec<(u64, u64)>) {
    let n = latest.len();
    (
        count,
        latest.skip(n.saturating_sub(STREAM_WAITS_TAIL)).collect(),
    )
}

/// One side of the differential: something that takes [`Call`]s and can be observed.
pub trait Side {
    /// The side's name in reports.
    fn name(&self) -> &'static str;

    /// Makes one call.
    fn call(&mut self, call: &Call) -> Outcome;

    /// Everything observable now.
    fn observe(&self) -> Result<Observation, String>;

    /// The side's own invariant checks.
    fn check_invariants(&self) -> Result<(), String>;

    /// This side as the allocator core, if it is one: with [`Side::as_model`] of the other
    /// side, the driver compares the two by [`quick::same_observed`] instead of building
    /// both observations after every step.
    fn as_core(&self) -> Option<&CoreSide> {
        None
    }

    /// This side as the model, if it is one ([`Side::as_core`]).
    fn as_model(&self) -> Option<&ModelSide> {
        None
    }
}

/// Compares two observations; the error names what differs.
pub fn compare_observations(
    (an, a): (&str, &Observation),
    (bn, b): (&str, &Observation),
) -> Result<(), String> {
    if !same_stats(&a.stats, &b.stats) {
        return Err(format!(
            "statistics differ ({an} vs {bn}): {}",
            diff_stats(&a.stats, &b.stats).join("; ")
        ));
    }
    if a.layout != b.layout {
        return Err(format!(
            "layouts differ:\n {an:9} {:x?}\n {bn:9} {:x?}",
            a.layout, b.layout
        ));
    }
    if a.device_used != b.device_used {
        return Err(format!(
            "device memory differs: {an}'s device {} vs {bn}'s {}",
            a.device_used, b.device_used
        ));
    }
    if a.stream_waits != b.stream_waits {
        return Err(format!(
            "stream waits differ (rule 23k): {an} logged {} ending {:?}, {bn} {} ending {:?}",
            a.stream_waits.0, a.stream_waits.1, b.stream_waits.0, b.stream_waits.1
        ));
    }
    if a.thread_cached_blocks != b.thread_cached_blocks {
        return Err(format!(
            "thread caches hold {} blocks in {an}, {} in {bn}",
            a.thread_cached_blocks, b.thread_cached_blocks
        ));
    }
    Ok(())
}

/// Whether two flattened statistics are equal: the same numbers under the same field names,
/// in the same order. The numbers are compared as two lists; the names as two interned lists
/// ([`FlatStats`]): the same list, or two found equal text for text once before (such pairs
/// are remembered), or compared text for text now.
pub fn same_stats(a: &FlatStats, b: &FlatStats) -> bool {
    type Key = (usize, usize, usize, usize);
    thread_local! {
        static SAME_NAMES: std::cell::RefCell<Vec<Key>> =
            const { std::cell::RefCell::new(Vec::new()) };
    }
    if a.values != b.values {
        return false;
    }
    if std::ptr::eq(a.names, b.names) {
        return true;
    }
    // Interned lists are never freed, so their addresses name them for good.
    let key = (
        a.names.as_ptr() as usize,
        a.names.len(),
        b.names.as_ptr() as usize,
        b.names.len(),
    );
    SAME_NAMES.with_borrow_mut(|known| {
        if known.contains(&key) {
            return true;
        }
        if a.names != b.names {
            return false;
        }
        known.push(key);
        true
    })
}

/// Statistics flattened through their `Serialize` impl (both crates' `Stats` serialise to the
/// same field names), or an error when they hold anything but structs of integers.
pub fn flatten_stats<T: serde::Serialize>(stats: &T) -> Result<FlatStats, String> {
    let unsupported = || "statistics are not structs of integers".to_string();
    // The names as keys (a list interned before is found by one comparison of memory); walked
    // a second time for their text only when the list is new.
    let (mut keys, mut values) = (Vec::with_capacity(256), Vec::with_capacity(256));
    flat::visit(stats, &mut |name, v| {
        keys.push(name_key(name));
        values.push(v);
    })
    .ok_or_else(unsupported)?;
    let names = intern(&keys, || {
        flat::numbers(stats).map(|n| n.0).unwrap_or_default()
    });
    Ok(FlatStats { names, values })
}

/// Every number of flattened statistics with its dotted path (`reserved_bytes.all.current`),
/// in serialisation order.
pub fn stat_paths(s: &FlatStats) -> Vec<(String, i128)> {
    let mut stack: Vec<&str> = Vec::new();
    let mut out = Vec::new();
    for (field, v) in s.iter() {
        match v {
            flat::OPEN => stack.push(field),
            flat::CLOSE => {
                stack.pop();
            }
            _ => {
                let mut p: Vec<&str> = stack.iter().copied().filter(|f| !f.is_empty()).collect();
                p.push(field);
                out.push((p.join("."), v));
            }
        }
    }
    out
}

impl Observation {
    /// The statistic at the dotted `path` (`num_device_free`, `reserved_bytes.all.current`).
    pub fn stat(&self, path: &str) -> Option<i128> {
        stat_paths(&self.stats)
            .into_iter()
            .find(|(p, _)| p == path)
            .map(|(_, v)| v)
    }
}

/// The fields of two flattened statistics that differ, as `path: a vs b`.
fn diff_stats(a: &FlatStats, b: &FlatStats) -> Vec<String> {
    let paths = stat_paths;
    let (pa, pb) = (paths(a), paths(b));
    let mut diffs: Vec<String> = pa
        .iter()
        .filter_map(|(p, va)| match pb.iter().find(|(q, _)| q == p) {
            Some((_, vb)) if vb == va => None,
            Some((_, vb)) => Some(format!("{p}: {va} vs {vb}")),
            None => Some(format!("{p} missing in the second")),
        })
        .collect();
    diffs.extend(
        pb.iter()
            .filter(|(p, _)| !pa.iter().any(|(q, _)| q == p))
            .map(|(p, _)| format!("{p} missing in the first")),
    );
    if diffs.is_empty() {
        diffs.push("the fields come in a different order".into());
    }
    diffs
}

/// Statistics flattened through their `Serialize` impl, for comparing them without building
/// JSON: a value made of structs and integers becomes, in serialisation order, one
/// `(field, number)` per integer and a `(field, OPEN)` / `(field, CLOSE)` pair around each
/// struct, so equal lists mean the two values serialise to equal JSON (the converse also needs
/// the same field order).
/// Anything else (strings, floats, sequences, ...) is unsupported: `numbers` gives `None`.
mod flat {
    use serde::ser::{self, Impossible, Serialize, SerializeStruct, Serializer};

    pub const OPEN: i128 = i128::MIN;
    pub const CLOSE: i128 = i128::MAX;

    /// The value's fields and integers in order (the names, the numbers), or `None` if it
    /// holds anything else.
    pub fn numbers<T: Serialize + ?Sized>(value: &T) -> Option<(Vec<&'static str>, Vec<i128>)> {
        let mut out = (Vec::with_capacity(256), Vec::with_capacity(256));
        visit(value, &mut |name, v| {
            out.0.push(name);
            out.1.push(v);
        })?;
        Some(out)
    }

    /// Gives `sink` the value's fields and integers in order, or `None` (part way) if it holds
    /// anything else.
    pub fn visit<T: Serialize + ?Sized>(
        value: &T,
        sink: &mut impl FnMut(&'static str, i128),
    ) -> Option<()> {
        value.serialize(Flat { sink, field: "" }).ok()
    }

    #[derive(Debug)]
    pub struct Unsupported;

    impl std::fmt::Display for Unsupported {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("not a struct of integers")
        }
    }

    impl std::error::Error for Unsupported {}

    impl ser::Error for Unsupported {
        fn custom<T: std::fmt::Display>(_: T) -> Self {
            Unsupported
        }
    }

    struct Flat<'a, F> {
        sink: &'a mut F,
        field: &'static str,
    }

    impl<F: FnMut(&'static str, i128)> Flat<'_, F> {
        fn push(self, v: i128) -> Result<(), Unsupported> {
            (self.sink)(self.field, v);
            Ok(())
        }
    }

    macro_rules! unsupported {
        ($($f:ident($($t:ty),*) -> $r:ty;)*) => {
            $(fn $f(self, $(_: $t),*) -> Result<$r, Unsupported> { Err(Unsupported) })*
        };
    }

    impl<'a, F: FnMut(&'static str, i128)> Serializer for Flat<'a, F> {
        type Ok = ();
        type Error = Unsupported;
        type SerializeSeq = Impossible<(), Unsupported>;
        type SerializeTuple = Impossible<(), Unsupported>;
        type SerializeTupleStruct = Impossible<(), Unsupported>;
        type SerializeTupleVariant = Impossible<(), Unsupported>;
        type SerializeMap = Impossible<(), Unsupported>;
        type SerializeStruct = Self;
        type SerializeStructVariant = Impossible<(), Unsupported>;

        fn serialize_i8(self, v: i8) -> Result<(), Unsupported> {
            self.push(v.into())
        }
        fn serialize_i16(self, v: i16) -> Result<(), Unsupported> {
            self.push(v.into())
        }
        fn serialize_i32(self, v: i32) -> Result<(), Unsupported> {
            self.push(v.into())
        }
        fn serialize_i64(self, v: i64) -> Result<(), Unsupported> {
            self.push(v.into())
        }
        fn serialize_u8(self, v: u8) -> Result<(), Unsupported> {
            self.push(v.into())
        }
        fn serialize_u16(self, v: u16) -> Result<(), Unsupported> {
            self.push(v.into())
        }
        fn serialize_u32(self, v: u32) -> Result<(), Unsupported> {
            self.push(v.into())
        }
        fn serialize_u64(self, v: u64) -> Result<(), Unsupported> {
            self.push(v.into())
        }
        fn serialize_struct(self, _: &'static str, _: usize) -> Result<Self, Unsupported> {
            (self.sink)(self.field, OPEN);
            Ok(self)
        }
        fn serialize_some<T: Serialize + ?Sized>(self, _: &T) -> Result<(), Unsupported> {
            Err(Unsupported)
        }
        fn serialize_newtype_struct<T: Serialize + ?Sized>(
            self,
            _: &'static str,
            _: &T,
        ) -> Result<(), Unsupported> {
            Err(Unsupported)
        }
        fn serialize_newtype_variant<T: Serialize + ?Sized>(
            self,
            _: &'static str,
            _: u32,
            _: &'static str,
            _: &T,
        ) -> Result<(), Unsupported> {
            Err(Unsupported)
        }
        unsupported! {
            serialize_bool(bool) -> ();
            serialize_f32(f32) -> ();
            serialize_f64(f64) -> ();
            serialize_char(char) -> ();
            serialize_str(&str) -> ();
            serialize_bytes(&[u8]) -> ();
            serialize_none() -> ();
            serialize_unit() -> ();
            serialize_unit_struct(&'static str) -> ();
            serialize_unit_variant(&'static str, u32, &'static str) -> ();
            serialize_seq(Option<usize>) -> Self::SerializeSeq;
            serialize_tuple(usize) -> Self::SerializeTuple;
            serialize_tuple_struct(&'static str, usize) -> Self::SerializeTupleStruct;
            serialize_tuple_variant(&'static str, u32, &'static str, usize) -> Self::SerializeTupleVariant;
            serialize_map(Option<usize>) -> Self::SerializeMap;
            serialize_struct_variant(&'static str, u32, &'static str, usize) -> Self::SerializeStructVariant;
        }
    }

    impl<F: FnMut(&'static str, i128)> SerializeStruct for Flat<'_, F> {
        type Ok = ();
        type Error = Unsupported;

        fn serialize_field<T: Serialize + ?Sized>(
            &mut self,
            key: &'static str,
            value: &T,
        ) -> Result<(), Unsupported> {
            value.serialize(Flat {
                sink: &mut *self.sink,
                field: key,
            })
        }

        fn end(self) -> Result<(), Unsupported> {
            self.push(CLOSE)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(serde::Serialize)]
    struct Inner {
        a: i64,
        b: u64,
    }
    #[derive(serde::Serialize)]
    struct Outer {
        x: Inner,
        y: u64,
    }
    #[derive(serde::Serialize)]
    struct Renamed {
        x: Inner,
        z: u64,
    }

    fn v(a: i64, y: u64) -> Outer {
        Outer {
            x: Inner { a, b: 2 },
            y,
        }
    }

    #[test]
    fn equal_lists_exactly_for_equal_json() {
        assert_eq!(flat::numbers(&v(1, 3)), flat::numbers(&v(1, 3)));
        assert_ne!(flat::numbers(&v(1, 3)), flat::numbers(&v(-1, 3)));
        assert_ne!(flat::numbers(&v(1, 3)), flat::numbers(&v(1, 4)));
        let r = Renamed {
            x: Inner { a: 1, b: 2 },
            z: 3,
        };
        assert_ne!(flat::numbers(&v(1, 3)), flat::numbers(&r));
        assert_eq!(flat::numbers("text"), None);
    }

    #[test]
    fn same_stats_is_equality() {
        let (a, b) = (
            flatten_stats(&v(1, 3)).unwrap(),
            flatten_stats(&v(1, 3)).unwrap(),
        );
        assert!(same_stats(&a, &b));
        // Now known by pointers: a change of value or of name is still seen.
        assert!(!same_stats(&a, &flatten_stats(&v(1, 4)).unwrap()));
        let r = flatten_stats(&Renamed {
            x: Inner { a: 1, b: 2 },
            z: 3,
        })
        .unwrap();
        assert!(!same_stats(&a, &r));
        assert!(!same_stats(&r, &a));
        // Equal text under other pointers (owned strings leaked): equal, and remembered.
        let leak = |s: &FlatStats| -> FlatStats {
            let pairs: Vec<(&'static str, i128)> = s
                .iter()
                .map(|(n, v)| (&*Box::leak(n.to_string().into_boxed_str()), v))
                .collect();
            FlatStats::from_pairs(&pairs)
        };
        let (la, lr) = (leak(&a), leak(&r));
        assert!(same_stats(&a, &la) && same_stats(&la, &a) && same_stats(&a, &la));
        assert!(!same_stats(&la, &lr));
        let mut pairs: Vec<(&'static str, i128)> = la.iter().collect();
        pairs[1].0 = "b";
        let renamed = FlatStats::from_pairs(&pairs);
        assert!(!same_stats(&a, &renamed));
        assert!(!same_stats(&a, &FlatStats::from_pairs(&pairs[1..])));
        assert!(same_stats(&renamed, &FlatStats::from_pairs(&pairs)));
        let pairs = |s: &FlatStats| s.iter().collect::<Vec<_>>();
        for (x, y) in [(&a, &b), (&a, &r), (&la, &lr), (&a, &renamed), (&la, &a)] {
            assert_eq!(same_stats(x, y), pairs(x) == pairs(y));
        }
    }

    #[test]
    fn a_difference_is_named_by_its_path() {
        let (a, b) = (
            flatten_stats(&v(1, 3)).unwrap(),
            flatten_stats(&v(5, 3)).unwrap(),
        );
        assert_eq!(diff_stats(&a, &b), vec!["x.a: 1 vs 5".to_string()]);
        let r = flatten_stats(&Renamed {
            x: Inner { a: 1, b: 2 },
            z: 3,
        })
        .unwrap();
        assert_eq!(
            diff_stats(&a, &r),
            vec![
                "y missing in the second".to_string(),
                "z missing in the first".to_string()
            ]
        );
    }
}
