//! The one operation type that drives property tests, fuzzing and the differential harness.
//!
//! The one rule: every `Op` is valid in every state. Live blocks are named by index modulo the
//! number of live blocks, so a shrunk or fuzzed sequence never refers to a block that does not
//! exist, and a failing case prints as a paste-ready list of operations.

use arbitrary::Unstructured;
use proptest::prelude::*;

/// Streams the harness uses: a handful, so cross-stream rules are exercised often.
pub const STREAMS: u8 = 3;

/// One step of a scenario.
///
/// `Arbitrary` (for cargo-fuzz) draws sizes, fractions and fault counts biased the way
/// [`op_strategy`] is: towards the policy's boundaries and mostly valid values.
#[derive(Clone, Debug, PartialEq, Eq, arbitrary::Arbitrary)]
pub enum Op {
    /// Allocate `size` bytes on stream `stream % STREAMS`.
    Malloc {
        /// Bytes requested.
        #[arbitrary(with = arbitrary_size)]
        size: u64,
        /// Stream index.
        stream: u8,
    },
    /// Free the live block number `pick % live`; with no live block, free an unknown address.
    Free {
        /// Index into the live blocks, modulo their count.
        pick: u16,
    },
    /// Mark live block `pick % live` as used on stream `stream % STREAMS`.
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
    /// Set the memory fraction to `per_mille / 1000` (values above 1000 are invalid on purpose).
    SetFraction {
        /// The fraction in thousandths.
        #[arbitrary(with = arbitrary_per_mille)]
        per_mille: u16,
    },
    /// The next `n` device allocations report out-of-memory.
    FailDeviceAllocs {
        /// How many.
        #[arbitrary(with = arbitrary_fault_count)]
        n: u8,
    },
    /// Free an address that is not a live allocation (a freed or foreign pointer).
    FreeForeign {
        /// The address; the harness makes sure it is not live.
        address: u64,
    },
    /// Adopt a segment the device already holds (rule 18): valid layouts most of the time,
    /// sometimes one that breaks one of rule 18a's checks (both sides must refuse it).
    Adopt {
        /// The segment and its layout.
        #[arbitrary(with = arbitrary_adopt)]
        segment: AdoptSpec,
    },
    /// The next successful device allocation takes this address when it is usable
    /// (`set_next_address`; `None` clears it).
    SetNextAddress {
        /// The address, or `None`.
        #[arbitrary(with = arbitrary_next_address)]
        address: Option<u64>,
    },
}

/// A segment to adopt, in plain numbers that convert to either crate's own type.
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
    /// The segment as the allocator takes it.
    pub fn to_allocator(&self) -> cachalot::AdoptedSegment {
        let stream = |s: u8| cachalot::StreamId(u64::from(s % STREAMS));
        cachalot::AdoptedSegment {
            address: self.address,
            size: self.size,
            stream: stream(self.stream),
            pool: if self.small {
                cachalot::sizes::Pool::Small
            } else {
                cachalot::sizes::Pool::Large
            },
            blocks: self
                .blocks
                .iter()
                .map(|b| cachalot::AdoptedBlock {
                    size: b.size,
                    state: match b.state {
                        0 => cachalot::AdoptedState::Free,
                        1 => cachalot::AdoptedState::Allocated {
                            requested: b.requested,
                        },
                        _ => cachalot::AdoptedState::Pending {
                            requested: b.requested,
                            streams: b.streams.iter().map(|&s| stream(s)).collect(),
                        },
                    },
                })
                .collect(),
        }
    }

    /// The segment as the model takes it.
    pub fn to_model(&self) -> cachalot_model::AdoptedSegment {
        let stream = |s: u8| u64::from(s % STREAMS);
        cachalot_model::AdoptedSegment {
            address: self.address,
            size: self.size,
            stream: stream(self.stream),
            small: self.small,
            blocks: self
                .blocks
                .iter()
                .map(|b| cachalot_model::AdoptedBlock {
                    size: b.size,
                    state: match b.state {
                        0 => cachalot_model::AdoptedState::Free,
                        1 => cachalot_model::AdoptedState::Allocated {
                            requested: b.requested,
                        },
                        _ => cachalot_model::AdoptedState::Pending {
                            requested: b.requested,
                            streams: b.streams.iter().map(|&s| stream(s)).collect(),
                        },
                    },
                })
                .collect(),
        }
    }

    /// The addresses of its allocated blocks (live allocations once adopted).
    pub fn allocated(&self) -> Vec<u64> {
        let mut address = self.address;
        let mut out = Vec::new();
        for b in &self.blocks {
            if b.state == 1 {
                out.push(address);
            }
            address = address.wrapping_add(b.size);
        }
        out
    }
}

/// Adopted segments and next addresses land in 2 MiB slots from 64 MiB below the simulated
/// devices' base address, so they meet (and sometimes overlap) the segments the devices place.
pub const ADOPT_REGION: u64 = 0x7f00_0000_0000 - 64 * MIB;

/// The raw numbers an [`AdoptSpec`] is built from (by both the strategy and `Arbitrary`).
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
        blocks.push(AdoptBlockSpec {
            size,
            state,
            requested,
            streams,
        });
        rem -= units;
        i += 1;
    }
    let mut spec = AdoptSpec {
        address: ADOPT_REGION + u64::from(raw.slot % 128) * 2 * MIB,
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

fn adopt_raw_strategy() -> impl Strategy<Value = AdoptRaw> {
    (
        any::<u8>(),
        any::<bool>(),
        any::<u8>(),
        0..STREAMS,
        proptest::collection::vec((any::<u32>(), any::<u8>(), any::<u32>(), any::<u8>()), 0..6),
        prop_oneof![4 => 12u8..=255, 1 => 0u8..12],
    )
        .prop_map(|(slot, small, units, stream, blocks, flaw)| AdoptRaw {
            slot,
            small,
            units,
            stream,
            blocks,
            flaw,
        })
}

/// A segment layout to adopt: valid four times in five, else broken in one of twelve ways.
pub fn adopt_strategy() -> impl Strategy<Value = AdoptSpec> {
    adopt_raw_strategy().prop_map(|raw| build_adopt(&raw))
}

/// An [`AdoptSpec`] for `Arbitrary` inputs, with the weights of [`adopt_strategy`].
pub fn arbitrary_adopt(u: &mut Unstructured<'_>) -> arbitrary::Result<AdoptSpec> {
    let slot = u.arbitrary()?;
    let small = u.arbitrary()?;
    let units = u.arbitrary()?;
    let stream = u.int_in_range(0..=STREAMS - 1)?;
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
    let flaw = if u.ratio(1u8, 5)? {
        u.int_in_range(0u8..=11)?
    } else {
        12
    };
    Ok(build_adopt(&AdoptRaw {
        slot,
        small,
        units,
        stream,
        blocks,
        flaw,
    }))
}

/// A next device address: mostly a 2 MiB slot of the adoption region, sometimes `None`, 0,
/// unaligned or overflowing.
pub fn next_address_strategy() -> impl Strategy<Value = Option<u64>> {
    prop_oneof![
        6 => any::<u8>().prop_map(|slot| Some(ADOPT_REGION + u64::from(slot % 128) * 2 * MIB)),
        1 => Just(None),
        1 => prop_oneof![Just(0u64), Just(ADOPT_REGION + 256), Just(u64::MAX - 511)].prop_map(Some),
    ]
}

/// A next device address for `Arbitrary` inputs, with the weights of [`next_address_strategy`].
pub fn arbitrary_next_address(u: &mut Unstructured<'_>) -> arbitrary::Result<Option<u64>> {
    Ok(match u.int_in_range(0u8..=7)? {
        0..=5 => Some(ADOPT_REGION + u64::from(u.arbitrary::<u8>()? % 128) * 2 * MIB),
        6 => None,
        _ => Some(*u.choose(&[0u64, ADOPT_REGION + 256, u64::MAX - 511])?),
    })
}

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;

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

/// A request size biased towards the boundaries.
pub fn size_strategy() -> impl Strategy<Value = u64> {
    prop_oneof![
        3 => proptest::sample::select(BOUNDARY_SIZES),
        2 => (proptest::sample::select(BOUNDARY_SIZES), -4i64..=4).prop_map(|(b, j)| b.saturating_add_signed(j * 512).max(1)),
        3 => 1u64..=MIB,
        2 => MIB..=24 * MIB,
        1 => 24 * MIB..=160 * MIB,
        1 => Just(0u64),
    ]
}

/// One operation, weighted so that allocations and frees dominate.
pub fn op_strategy() -> impl Strategy<Value = Op> {
    prop_oneof![
        10 => (size_strategy(), 0..STREAMS).prop_map(|(size, stream)| Op::Malloc { size, stream }),
        8 => any::<u16>().prop_map(|pick| Op::Free { pick }),
        2 => (any::<u16>(), 0..STREAMS).prop_map(|(pick, stream)| Op::RecordStream { pick, stream }),
        2 => (0..STREAMS).prop_map(|stream| Op::CompleteStream { stream }),
        1 => Just(Op::EmptyCache),
        1 => prop_oneof![0u16..=1000, Just(1001u16)].prop_map(|per_mille| Op::SetFraction { per_mille }),
        1 => (1u8..=3).prop_map(|n| Op::FailDeviceAllocs { n }),
        1 => any::<u64>().prop_map(|address| Op::FreeForeign { address }),
        1 => adopt_strategy().prop_map(|segment| Op::Adopt { segment }),
        1 => next_address_strategy().prop_map(|address| Op::SetNextAddress { address }),
    ]
}

/// A request size for `Arbitrary` inputs, with the weights of [`size_strategy`]: a boundary
/// size, a boundary nudged by a few multiples of 512, a small, medium or large size, zero, or
/// (rarely) any 64-bit value.
pub fn arbitrary_size(u: &mut Unstructured<'_>) -> arbitrary::Result<u64> {
    let boundary =
        |u: &mut Unstructured<'_>| -> arbitrary::Result<u64> { Ok(*u.choose(BOUNDARY_SIZES)?) };
    Ok(match u.int_in_range(0u8..=12)? {
        0..=2 => boundary(u)?,
        3..=4 => {
            let b = boundary(u)?;
            let j = u.int_in_range(-4i64..=4)?;
            b.saturating_add_signed(j * 512).max(1)
        }
        5..=7 => u.int_in_range(1..=MIB)?,
        8..=9 => u.int_in_range(MIB..=24 * MIB)?,
        10 => u.int_in_range(24 * MIB..=160 * MIB)?,
        11 => 0,
        _ => u.arbitrary()?,
    })
}

/// A memory fraction in thousandths for `Arbitrary` inputs: mostly valid (0..=1000), sometimes
/// just invalid (1001), as [`op_strategy`] draws it.
pub fn arbitrary_per_mille(u: &mut Unstructured<'_>) -> arbitrary::Result<u16> {
    u.int_in_range(0u16..=1001)
}

/// How many device allocations fail, for `Arbitrary` inputs: 1 to 3, as [`op_strategy`] draws it.
pub fn arbitrary_fault_count(u: &mut Unstructured<'_>) -> arbitrary::Result<u8> {
    u.int_in_range(1u8..=3)
}
