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
