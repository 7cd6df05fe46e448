//! The operations that drive the property tests, the fuzz targets and the threaded harness,
//! and how they are drawn.
//!
//! The one rule: every `Op` is valid in every state. Live blocks are named by index modulo the
//! number of live blocks, so a shrunk or fuzzed sequence never refers to a block that does not
//! exist, and a failing case prints as a paste-ready list of operations. What an operation
//! becomes in a given state (which address a `pick` names) is the driver's business
//! ([`crate::driver::Handles`]); this module only says what operations exist and how often each
//! is drawn: the tables below are the only place weights are written.

use arbitrary::{Arbitrary, Unstructured};

use crate::draw::{Draws, Weighted, draw, weighted};
use crate::side::{Adoption, AdoptionBlock, AdoptionState};

/// Streams the harness uses: a handful, so cross-stream rules are exercised often.
pub const STREAMS: u8 = 3;

/// Threads the threaded harness uses.
pub const THREADS: u8 = 3;

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;

/// One step of a scenario.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Op {
    /// Allocate `size` bytes on stream `stream % STREAMS`.
    Malloc {
        /// Bytes requested.
        size: u64,
        /// Stream index.
        stream: u8,
    },
    /// Free the live block number `pick % live`; with no live block, free an address that is
    /// not live.
    Free {
        /// Index into the live blocks, modulo their count.
        pick: u16,
    },
    /// Mark live block `pick % live` as used on stream `stream % STREAMS`; with no live block,
    /// an address that is not live.
    RecordStream {
        /// Index into the live blocks, modulo their count.
        pick: u16,
        /// Stream index.
        stream: u8,
    },
    /// Complete the work queued on stream `stream % STREAMS` so far (its events complete).
    CompleteStream {
        /// Stream index.
        stream: u8,
    },
    /// Release every whole free segment.
    EmptyCache,
    /// Set the memory fraction to [`fraction`]`(per_mille)`: thousandths up to 1000, then
    /// invalid values (above one, NaN, negative).
    SetFraction {
        /// The fraction in thousandths, or an invalid one.
        per_mille: u16,
    },
    /// The next `n` device allocations report out-of-memory.
    FailDeviceAllocs {
        /// How many.
        n: u8,
    },
    /// Free an address that is not a live allocation: the null address, a block freed earlier
    /// (a double free), an address inside a live block, or any other (see
    /// [`crate::driver::Handles::foreign`]).
    FreeForeign {
        /// The raw address the choice is made from.
        address: u64,
    },
    /// Mark an address that is not a live allocation (chosen as for `FreeForeign`, the null
    /// address included) as used on stream `stream % STREAMS`.
    RecordStreamForeign {
        /// The raw address the choice is made from.
        address: u64,
        /// Stream index.
        stream: u8,
    },
    /// Adopt a segment the device already holds (rule 18): valid layouts most of the time,
    /// sometimes one that breaks one of rule 18a's checks (both sides must refuse it).
    Adopt {
        /// The segment and its layout.
        segment: AdoptSpec,
    },
    /// Adopt a range of expandable segments the device already holds (rule 18f): valid
    /// layouts most of the time, sometimes one that breaks one of its checks (both sides must
    /// refuse it); without expandable segments both refuse every one.
    AdoptRange {
        /// The range's first address and its first blocks (state 3: unmapped).
        range: AdoptSpec,
    },
    /// The next successful device allocation takes this address when it is usable
    /// (`set_next_address`; `None` clears it).
    SetNextAddress {
        /// The address, or `None`.
        address: Option<u64>,
    },
    /// Change the run-time settings (rule 24): `max_split_size` of [`RUNTIME_MAX_SPLIT_MB`]
    /// (`max_split % len`; 0 MiB: none), every interval's `roundup_power2_divisions` of
    /// [`RUNTIME_DIVISIONS`], `garbage_collection_threshold` of [`RUNTIME_GC`].
    SetRuntimeSettings {
        /// Index into [`RUNTIME_MAX_SPLIT_MB`].
        max_split: u8,
        /// Index into [`RUNTIME_DIVISIONS`].
        divisions: u8,
        /// Index into [`RUNTIME_GC`].
        gc: u8,
    },
    /// Give back the free whole segments of stream `stream % STREAMS` (rule 25).
    ReleaseStream {
        /// Stream index.
        stream: u8,
    },
}

/// The `max_split_size` values (MiB) a `SetRuntimeSettings` op sets; 0 is none.
pub const RUNTIME_MAX_SPLIT_MB: &[u64] = &[0, 20, 32, 64, 128];
/// The `roundup_power2_divisions` a `SetRuntimeSettings` op sets.
pub const RUNTIME_DIVISIONS: &[u64] = &[0, 1, 2, 4, 8];
/// The `garbage_collection_threshold` values a `SetRuntimeSettings` op sets; 0 is off.
pub const RUNTIME_GC: &[f64] = &[0.0, 0.5, 0.8];

/// Whether an operation is one the threaded side (the front end) does not offer: rules 24
/// and 25 are the core's alone.
pub fn core_only(op: &Op) -> bool {
    matches!(op, Op::SetRuntimeSettings { .. } | Op::ReleaseStream { .. })
}

/// One step of a threaded scenario: an operation on a named thread, or a thread's own step.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ThreadOp {
    /// `op` on thread `thread % THREADS`.
    On {
        /// Thread index.
        thread: u8,
        /// The operation.
        op: Op,
    },
    /// Thread `thread % THREADS` frees a block it allocated itself (number `pick` modulo their
    /// count; with none, any live block, as `Op::Free`): the frees thread caches keep.
    FreeOwn {
        /// Thread index.
        thread: u8,
        /// Index into the thread's live blocks, modulo their count.
        pick: u16,
    },
    /// Thread `thread % THREADS` frees the blocks its cache keeps.
    Flush {
        /// Thread index.
        thread: u8,
    },
    /// Thread `thread % THREADS` exits; a fresh thread takes its index.
    Retire {
        /// Thread index.
        thread: u8,
    },
}

/// The memory fraction a `SetFraction` op sets: `per_mille / 1000` up to 1000, then just above
/// one (1001), NaN (1002) and negative (1003 and above): both sides must refuse those.
pub fn fraction(per_mille: u16) -> f64 {
    match per_mille {
        0..=1001 => f64::from(per_mille) / 1000.0,
        1002 => f64::NAN,
        _ => -f64::from(per_mille - 1002) / 1000.0,
    }
}

// ---------------------------------------------------------------------------------------------
// The tables: how often each operation, size and value is drawn.
// ---------------------------------------------------------------------------------------------

/// Sizes at the policy's boundaries: tiny, 512 B, 1 MiB ± 512, 2 MiB, 10 MiB ± 512, 20 MiB,
/// common `max_split_size` values, and huge.
pub const BOUNDARY_SIZES: &[u64] = &[
    1,
    511,
    512,
    513,
    4 * KIB,
    MIB - 512,
    MIB,
    MIB + 512,
    2 * MIB,
    2 * MIB + 512,
    10 * MIB - 512,
    10 * MIB,
    10 * MIB + 512,
    20 * MIB - 512,
    20 * MIB,
    20 * MIB + 512,
    40 * MIB,
    64 * MIB,
    128 * MIB,
    1 << 30,
    1 << 40,
    (1 << 60) + 1,
];

/// Request sizes: a boundary, a boundary nudged by a few multiples of 512, a small, medium or
/// large size, zero, or any 64-bit value.
pub const SIZES: &Draws<u64> = &[
    (3, |u| Ok(*u.choose(BOUNDARY_SIZES)?)),
    (2, |u| {
        let b = *u.choose(BOUNDARY_SIZES)?;
        let j = u.int_in_range(-4i64..=4)?;
        Ok(b.saturating_add_signed(j * 512).max(1))
    }),
    (3, |u| u.int_in_range(1..=MIB)),
    (2, |u| u.int_in_range(MIB..=24 * MIB)),
    (1, |u| u.int_in_range(24 * MIB..=160 * MIB)),
    (1, |_| Ok(0)),
    (1, |u| u.arbitrary()),
];

/// The sizes of requests repeated on purpose (so thread caches hit).
pub const REPEATED_SIZES: &[u64] = &[512, 4096, MIB, 3 * MIB, 24 * MIB];

/// The raw address of a `FreeForeign` or `RecordStreamForeign`: the null address, or any.
pub const FOREIGN_ADDRESSES: &Draws<u64> = &[(1, |_| Ok(0)), (4, |u| u.arbitrary())];

/// Memory fractions in thousandths: any valid one, the valid extremes, an invalid one.
pub const FRACTIONS: &Draws<u16> = &[
    (6, |u| u.int_in_range(0..=1000)),
    (1, |u| Ok(*u.choose(&[0, 1000])?)),
    (1, |u| u.int_in_range(1001..=1003)),
];

/// How many device allocations a `FailDeviceAllocs` fails.
pub const FAULT_COUNTS: &Weighted<u8> = &[(1, 1), (1, 2), (1, 3)];

/// Next device addresses: mostly a 2 MiB slot of the adoption region, sometimes `None`, and
/// sometimes one that is not usable (null, unaligned, overflowing).
pub const NEXT_ADDRESSES: &Draws<Option<u64>> = &[
    (6, |u| Ok(Some(adopt_slot(u.arbitrary()?)))),
    (1, |_| Ok(None)),
    (1, |u| {
        Ok(Some(*u.choose(&[
            0u64,
            ADOPT_REGION + 256,
            u64::MAX - 511,
        ])?))
    }),
];

/// Adoption layouts: valid four times in five, else broken in one of twelve ways
/// ([`build_adopt`]'s `flaw`).
pub const ADOPT_FLAWS: &Draws<u8> = &[(4, |_| Ok(NO_FLAW)), (1, |u| u.int_in_range(0..=11))];

fn stream(u: &mut Unstructured<'_>) -> arbitrary::Result<u8> {
    u.int_in_range(0..=STREAMS - 1)
}

fn thread(u: &mut Unstructured<'_>) -> arbitrary::Result<u8> {
    u.int_in_range(0..=THREADS - 1)
}

/// Operations: allocations and frees dominate.
pub const OPS: &Draws<Op> = &[
    (10, |u| {
        Ok(Op::Malloc {
            size: draw(u, SIZES)?,
            stream: stream(u)?,
        })
    }),
    (8, |u| {
        Ok(Op::Free {
            pick: u.arbitrary()?,
        })
    }),
    (2, |u| {
        Ok(Op::RecordStream {
            pick: u.arbitrary()?,
            stream: stream(u)?,
        })
    }),
    (2, |u| Ok(Op::CompleteStream { stream: stream(u)? })),
    (1, |_| Ok(Op::EmptyCache)),
    (1, |u| {
        Ok(Op::SetFraction {
            per_mille: draw(u, FRACTIONS)?,
        })
    }),
    (1, |u| {
        Ok(Op::FailDeviceAllocs {
            n: weighted(u, FAULT_COUNTS)?,
        })
    }),
    (1, |u| {
        Ok(Op::FreeForeign {
            address: draw(u, FOREIGN_ADDRESSES)?,
        })
    }),
    (1, |u| {
        Ok(Op::RecordStreamForeign {
            address: draw(u, FOREIGN_ADDRESSES)?,
            stream: stream(u)?,
        })
    }),
    (1, |u| {
        Ok(Op::Adopt {
            segment: AdoptSpec::arbitrary(u)?,
        })
    }),
    (1, |u| {
        Ok(Op::SetNextAddress {
            address: draw(u, NEXT_ADDRESSES)?,
        })
    }),
    (1, |u| {
        Ok(Op::AdoptRange {
            range: AdoptSpec::arbitrary_range(u)?,
        })
    }),
    (1, |u| {
        Ok(Op::SetRuntimeSettings {
            max_split: u.int_in_range(0..=(RUNTIME_MAX_SPLIT_MB.len() - 1) as u8)?,
            divisions: u.int_in_range(0..=(RUNTIME_DIVISIONS.len() - 1) as u8)?,
            gc: u.int_in_range(0..=(RUNTIME_GC.len() - 1) as u8)?,
        })
    }),
    (1, |u| Ok(Op::ReleaseStream { stream: stream(u)? })),
];

/// The streams of repeated requests: mostly stream 0.
pub const REPEATED_STREAMS: &Draws<u8> = &[(3, |_| Ok(0)), (1, stream)];

/// Threaded operations: any operation on a random thread, requests of a few repeated sizes
/// (mostly on stream 0, so thread caches hit), frees of the thread's own blocks, cache
/// flushes and thread exits.
pub const THREAD_OPS: &Draws<ThreadOp> = &[
    (10, |u| {
        let thread = thread(u)?;
        let op = Op::arbitrary(u)?;
        // The front end offers neither rule 24 nor rule 25: an empty cache instead.
        let op = if core_only(&op) { Op::EmptyCache } else { op };
        Ok(ThreadOp::On { thread, op })
    }),
    (8, |u| {
        let thread = thread(u)?;
        let size = *u.choose(REPEATED_SIZES)?;
        let stream = draw(u, REPEATED_STREAMS)?;
        Ok(ThreadOp::On {
            thread,
            op: Op::Malloc { size, stream },
        })
    }),
    (6, |u| {
        Ok(ThreadOp::FreeOwn {
            thread: thread(u)?,
            pick: u.arbitrary()?,
        })
    }),
    (1, |u| Ok(ThreadOp::Flush { thread: thread(u)? })),
    (1, |u| Ok(ThreadOp::Retire { thread: thread(u)? })),
];

impl<'a> Arbitrary<'a> for Op {
    fn arbitrary(u: &mut Unstructured<'a>) -> arbitrary::Result<Op> {
        draw(u, OPS)
    }
}

impl<'a> Arbitrary<'a> for ThreadOp {
    fn arbitrary(u: &mut Unstructured<'a>) -> arbitrary::Result<ThreadOp> {
        draw(u, THREAD_OPS)
    }
}

// ---------------------------------------------------------------------------------------------
// Adoption layouts
// ---------------------------------------------------------------------------------------------

/// A segment to adopt, in plain numbers (stream indices), as the operation carries it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AdoptSpec {
    /// The segment's address.
    pub address: u64,
    /// The segment's size.
    pub size: u64,
    /// Stream index (`% STREAMS`).
    pub stream: u8,
    /// Small pool (else large).
    pub small: bool,
    /// The blocks in address order.
    pub blocks: Vec<AdoptBlockSpec>,
}

/// One block of an [`AdoptSpec`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AdoptBlockSpec {
    /// The block's size.
    pub size: u64,
    /// 0 free, 1 allocated, 2 pending.
    pub state: u8,
    /// Bytes requested (allocated and pending blocks).
    pub requested: u64,
    /// Stream indices (`% STREAMS`) a pending block waits for.
    pub streams: Vec<u8>,
}

impl AdoptSpec {
    /// The segment as both sides take it: streams resolved, states named.
    pub fn resolve(&self) -> Adoption {
        let stream = |s: u8| u64::from(s % STREAMS);
        Adoption {
            range: false,
            address: self.address,
            size: self.size,
            stream: stream(self.stream),
            small: self.small,
            blocks: self
                .blocks
                .iter()
                .map(|b| AdoptionBlock {
                    size: b.size,
                    state: match b.state {
                        0 => AdoptionState::Free,
                        3 => AdoptionState::Unmapped,
                        1 => AdoptionState::Allocated {
                            requested: b.requested,
                        },
                        _ => AdoptionState::Pending {
                            requested: b.requested,
                            streams: b.streams.iter().map(|&s| stream(s)).collect(),
                        },
                    },
                })
                .collect(),
        }
    }
}

impl AdoptSpec {
    /// The range as both sides take it (rule 18f): streams resolved, states named; its size
    /// is rule 19's, so `size` is not used.
    pub fn resolve_range(&self) -> Adoption {
        Adoption {
            range: true,
            size: 0,
            ..self.resolve()
        }
    }

    /// A range layout to adopt (rule 18f): valid four times in five, else broken in one of
    /// twelve ways ([`build_range`]).
    pub fn arbitrary_range(u: &mut Unstructured<'_>) -> arbitrary::Result<AdoptSpec> {
        let slot = u.arbitrary()?;
        let small = u.arbitrary()?;
        let units = u.arbitrary()?;
        let stream = stream(u)?;
        let n = u.int_in_range(0usize..=5)?;
        let mut blocks = Vec::with_capacity(n);
        for _ in 0..n {
            blocks.push((
                u.arbitrary()?,
                u.arbitrary()?,
                u.arbitrary()?,
                u.arbitrary()?,
            ));
        }
        let flaw = draw(u, ADOPT_FLAWS)?;
        Ok(build_range(&AdoptRaw {
            slot,
            small,
            units,
            stream,
            blocks,
            flaw,
        }))
    }
}

/// Builds a range layout (rule 18f) from raw numbers: runs of 20 MiB of mapped blocks (whole
/// pages under either large page the knobs draw, 2 or 20 MiB), maybe an unmapped 20 MiB
/// first and unmapped 20 or 40 MiB between two runs, the mapped blocks free, allocated and
/// pending on the harness's streams as the pool allows; then (for `flaw` below 12) one thing
/// that makes it invalid.
pub fn build_range(raw: &AdoptRaw) -> AdoptSpec {
    const CHUNK: u64 = 20 * MIB;
    const UNIT: u64 = 512;
    let stream = raw.stream % STREAMS;
    let unmapped = |size| AdoptBlockSpec {
        size,
        state: 3,
        requested: 0,
        streams: Vec::new(),
    };
    let entries: Vec<(u32, u8, u32, u8)> = if raw.blocks.is_empty() {
        vec![(u32::MAX, 0, 0, 0)]
    } else {
        raw.blocks.clone()
    };
    let mut blocks: Vec<AdoptBlockSpec> = Vec::new();
    if raw.units.is_multiple_of(4) {
        blocks.push(unmapped(CHUNK));
    }
    let runs: &[u64] = match raw.units % 3 {
        0 => &[1],
        1 => &[2],
        _ => &[1, 1],
    };
    let mut run_starts = Vec::new();
    for (k, &chunks) in runs.iter().enumerate() {
        if k > 0 {
            blocks.push(unmapped(CHUNK * (1 + u64::from(raw.slot % 2))));
        }
        run_starts.push(blocks.len());
        let start = blocks.len();
        let mut rem = chunks * CHUNK / UNIT;
        let mut i = 0;
        while rem > 0 {
            let (r_size, r_state, r_req, mask) = entries[i % entries.len()];
            let r = u64::from(r_size);
            let prev_free = blocks.len() > start && blocks.last().is_some_and(|b| b.state == 0);
            let mut state = match r_state % 8 {
                0..=2 => 0,
                3..=5 => 1,
                _ => 2,
            };
            if i >= 6 {
                state = if prev_free { 1 } else { 0 };
            }
            if state == 0 && prev_free {
                state = 1;
            }
            let units = if state == 0 {
                if i >= 6 { rem } else { 1 + r % rem }
            } else if raw.small {
                (1 + r % 2048).min(rem)
            } else if rem <= 2048 {
                0
            } else if i >= 6 {
                rem
            } else {
                2049 + r % (rem - 2048)
            };
            if units == 0 {
                // A large block in use does not fit what is left: the rest is free.
                match blocks.last_mut() {
                    Some(b) if prev_free => b.size += rem * UNIT,
                    _ => blocks.push(AdoptBlockSpec {
                        size: rem * UNIT,
                        state: 0,
                        requested: 0,
                        streams: Vec::new(),
                    }),
                }
                break;
            }
            let size = units * UNIT;
            blocks.push(block_spec(size, state, r_req, mask, stream));
            rem -= units;
            i += 1;
        }
    }
    let mut spec = AdoptSpec {
        address: adopt_slot(raw.slot),
        size: 0,
        stream,
        small: raw.small,
        blocks,
    };
    let first = run_starts[0];
    let last = spec.blocks.len() - 1;
    match raw.flaw {
        0 => spec.address = 0,
        1 => spec.address += MIB,
        2 => spec.address = (u64::MAX - MIB) & !(2 * MIB - 1),
        3 => spec.blocks.insert(0, unmapped(UNIT)),
        4 => spec.blocks[first].size += 100,
        5 => {
            if spec.blocks.get(first + 1).is_some_and(|b| b.state != 3) {
                for b in &mut spec.blocks[first..first + 2] {
                    b.state = 0;
                    b.requested = 0;
                    b.streams.clear();
                }
            } else {
                spec.blocks[first].size = 0;
            }
        }
        6 => {
            let b = &mut spec.blocks[last];
            b.state = 1;
            b.requested = if raw.slot.is_multiple_of(2) {
                b.size + 1
            } else {
                0
            };
        }
        7 => {
            let b = &mut spec.blocks[first];
            b.state = 2;
            b.requested = 512;
            b.streams = vec![stream];
        }
        8 => {
            // A block in use of a size its pool never hands out.
            let run: u64 = spec.blocks[first..]
                .iter()
                .take_while(|b| b.state != 3)
                .map(|b| b.size)
                .sum();
            let n = spec.blocks[first..]
                .iter()
                .take_while(|b| b.state != 3)
                .count();
            let used = if raw.small { 2 * MIB } else { MIB };
            spec.blocks.splice(
                first..first + n,
                [
                    AdoptBlockSpec {
                        size: used,
                        state: 1,
                        requested: 512,
                        streams: Vec::new(),
                    },
                    AdoptBlockSpec {
                        size: run - used,
                        state: 0,
                        requested: 0,
                        streams: Vec::new(),
                    },
                ],
            );
        }
        9 => spec.blocks = vec![unmapped(CHUNK)],
        10 => spec.blocks.push(unmapped(CHUNK)),
        11 => spec.blocks.clear(),
        _ => {}
    }
    spec
}

impl<'a> Arbitrary<'a> for AdoptSpec {
    /// A layout to adopt: valid four times in five, else broken in one of twelve ways.
    fn arbitrary(u: &mut Unstructured<'a>) -> arbitrary::Result<AdoptSpec> {
        let slot = u.arbitrary()?;
        let small = u.arbitrary()?;
        let units = u.arbitrary()?;
        let stream = stream(u)?;
        let n = u.int_in_range(0usize..=5)?;
        let mut blocks = Vec::with_capacity(n);
        for _ in 0..n {
            blocks.push((
                u.arbitrary()?,
                u.arbitrary()?,
                u.arbitrary()?,
                u.arbitrary()?,
            ));
        }
        let flaw = draw(u, ADOPT_FLAWS)?;
        Ok(build_adopt(&AdoptRaw {
            slot,
            small,
            units,
            stream,
            blocks,
            flaw,
        }))
    }
}

/// The `flaw` of an [`AdoptRaw`] that breaks nothing.
pub const NO_FLAW: u8 = 12;

/// The address of 2 MiB slot `slot % 128` of the adoption region.
pub fn adopt_slot(slot: u8) -> u64 {
    ADOPT_REGION + u64::from(slot % 128) * 2 * MIB
}

/// Adopted segments and next addresses land in 2 MiB slots from 64 MiB below the simulated
/// devices' base address, so they meet (and sometimes overlap) the segments the devices place.
pub const ADOPT_REGION: u64 = 0x7f00_0000_0000 - 64 * MIB;

/// The raw numbers an [`AdoptSpec`] is built from.
#[derive(Clone, Debug)]
pub struct AdoptRaw {
    /// Address slot (`% 128`, 2 MiB apart from [`ADOPT_REGION`]).
    pub slot: u8,
    /// Small pool.
    pub small: bool,
    /// Large segment size in 2 MiB units (`5 + % 28`: 10 to 64 MiB).
    pub units: u8,
    /// Segment stream index.
    pub stream: u8,
    /// Per block: raw size, raw state, raw requested, stream mask (cycled through).
    pub blocks: Vec<(u32, u8, u32, u8)>,
    /// Which check to break; 12 and above: none.
    pub flaw: u8,
}

/// One block of a built layout from its raw draws: free (`state` 0), allocated (1) or
/// pending (2) with a requested size of 1..=`size` (the whole block one time in three) and,
/// when pending, the streams `mask` names plus one other than `stream` if it names none.
fn block_spec(size: u64, state: u8, r_req: u32, mask: u8, stream: u8) -> AdoptBlockSpec {
    let requested = if state == 0 {
        0
    } else if r_req.is_multiple_of(3) {
        size
    } else {
        1 + u64::from(r_req) % size
    };
    let mut streams: Vec<u8> = if state == 2 {
        (0..STREAMS).filter(|&s| mask & (1 << s) != 0).collect()
    } else {
        Vec::new()
    };
    if state == 2 && streams.iter().all(|&s| s == stream) {
        streams.push((stream + 1) % STREAMS);
    }
    AdoptBlockSpec {
        size,
        state,
        requested,
        streams,
    }
}

/// Builds a layout from raw numbers: a valid tiling with free, allocated and pending blocks
/// on the harness's streams, then (for `flaw` below 12) one thing that makes it invalid.
pub fn build_adopt(raw: &AdoptRaw) -> AdoptSpec {
    const UNIT: u64 = 512;
    let stream = raw.stream % STREAMS;
    let total_units = if raw.small {
        4096
    } else {
        u64::from(5 + raw.units % 28) * 4096
    };
    let entries: Vec<(u32, u8, u32, u8)> = if raw.blocks.is_empty() {
        vec![(u32::MAX, 0, 0, 0)]
    } else {
        raw.blocks.clone()
    };
    let mut blocks: Vec<AdoptBlockSpec> = Vec::new();
    let mut rem = total_units;
    let mut i = 0;
    while rem > 0 {
        let (r_size, r_state, r_req, mask) = entries[i % entries.len()];
        let r = u64::from(r_size);
        // At most 12 blocks cut at random; the rest is taken in as few blocks as the pool allows.
        let units = if raw.small && i >= 12 {
            rem.min(2048)
        } else if raw.small {
            1 + r % rem.min(2048)
        } else if rem < 2 * 2049 || r.is_multiple_of(4) || i >= 12 {
            rem
        } else {
            2049 + r % (rem - 2 * 2049 + 1)
        };
        let size = units * UNIT;
        let mut state = match r_state % 8 {
            0..=2 => 0,
            3..=5 => 1,
            _ => 2,
        };
        if state == 0 && blocks.last().is_some_and(|b| b.state == 0) {
            state = 1;
        }
        blocks.push(block_spec(size, state, r_req, mask, stream));
        rem -= units;
        i += 1;
    }
    let mut spec = AdoptSpec {
        address: adopt_slot(raw.slot),
        size: total_units * UNIT,
        stream,
        small: raw.small,
        blocks,
    };
    let last = spec.blocks.len() - 1;
    match raw.flaw {
        0 => spec.address = 0,
        1 => spec.address += 256,
        2 => spec.address = (u64::MAX - MIB) & !511,
        3 => spec.size += 512,
        4 => spec.blocks[0].size += 100,
        5 => {
            if last > 0 {
                spec.blocks[0].state = 0;
                spec.blocks[0].requested = 0;
                spec.blocks[1].state = 0;
                spec.blocks[1].requested = 0;
            } else {
                spec.blocks[0].size = 0;
            }
        }
        6 => {
            let b = &mut spec.blocks[last];
            b.state = 1;
            b.requested = if raw.slot.is_multiple_of(2) {
                b.size + 1
            } else {
                0
            };
        }
        7 => {
            let b = &mut spec.blocks[0];
            b.state = 2;
            b.requested = 512;
            b.streams = vec![stream];
        }
        8 => {
            let half = spec.size / 2;
            let (a, b) = if raw.small {
                (half + 512, half - 512)
            } else {
                (MIB, spec.size - MIB)
            };
            spec.blocks = vec![
                AdoptBlockSpec {
                    size: a,
                    state: 1,
                    requested: 512,
                    streams: Vec::new(),
                },
                AdoptBlockSpec {
                    size: b,
                    state: 0,
                    requested: 0,
                    streams: Vec::new(),
                },
            ];
        }
        9 => spec.small = !spec.small,
        10 => {
            spec.small = false;
            spec.size = 4 * MIB;
            spec.blocks = vec![AdoptBlockSpec {
                size: 4 * MIB,
                state: 0,
                requested: 0,
                streams: Vec::new(),
            }];
        }
        11 => spec.blocks.clear(),
        _ => {}
    }
    spec
}
