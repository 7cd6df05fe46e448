//! Scenarios: a device, settings, and a sequence of operations.
//!
//! The one rule: a scenario describes settings once, in plain numbers, and converts them into
//! each crate's own configuration type; the two crates never see each other's types.

use cachalot::Settings;
use cachalot_model::ModelConfig;
use proptest::prelude::*;

use crate::op::{Op, op_strategy};

const MIB: u64 = 1 << 20;

/// The policy knobs a scenario varies, in plain numbers.
#[derive(Clone, Debug, PartialEq)]
pub struct Knobs {
    /// Simulated device capacity in bytes.
    pub capacity: u64,
    /// `max_split_size` in bytes (`u64::MAX` for unlimited).
    pub max_split_size: u64,
    /// `max_non_split_rounding_size` in bytes.
    pub max_non_split_rounding_size: u64,
    /// `garbage_collection_threshold` (0 = off).
    pub garbage_collection_threshold: f64,
    /// `roundup_power2_divisions`, one entry per interval.
    pub roundup_power2_divisions: [u64; 16],
    /// A memory fraction set at the start.
    pub memory_fraction: Option<f64>,
    /// `expandable_segments` (rule 19).
    pub expandable_segments: bool,
}

impl Knobs {
    /// PyTorch's defaults on a device of `capacity` bytes.
    pub fn pytorch(capacity: u64) -> Knobs {
        Knobs {
            capacity,
            max_split_size: u64::MAX,
            max_non_split_rounding_size: 20 * MIB,
            garbage_collection_threshold: 0.0,
            roundup_power2_divisions: [0; 16],
            memory_fraction: None,
            expandable_segments: false,
        }
    }

    /// The allocator's settings.
    pub fn settings(&self) -> Settings {
        let mut s = Settings::pytorch();
        s.max_split_size = self.max_split_size;
        s.max_non_split_rounding_size = self.max_non_split_rounding_size;
        s.garbage_collection_threshold = self.garbage_collection_threshold;
        s.roundup_power2_divisions = self.roundup_power2_divisions;
        s.per_process_memory_fraction = self.memory_fraction;
        s.expandable_segments = self.expandable_segments;
        s
    }

    /// The model's configuration.
    pub fn model_config(&self, address_script: Vec<u64>) -> ModelConfig {
        let mut c = ModelConfig::pytorch_defaults(self.capacity);
        c.max_split_size = self.max_split_size;
        c.max_non_split_rounding_size = self.max_non_split_rounding_size;
        c.garbage_collection_threshold = self.garbage_collection_threshold;
        c.roundup_power2_divisions = self.roundup_power2_divisions;
        c.memory_fraction = self.memory_fraction;
        c.address_script = address_script;
        c.expandable_segments = self.expandable_segments;
        c
    }
}

/// Knobs for property tests: small capped devices so out-of-memory and its retry path are
/// common, and every setting varied.
pub fn knobs_strategy() -> impl Strategy<Value = Knobs> {
    let divisions = prop_oneof![
        3 => Just([0u64; 16]),
        1 => Just([4u64; 16]),
        1 => Just([2u64; 16]),
        1 => Just({
            let mut d = [8u64; 16];
            d[0] = 1;
            d[1] = 2;
            d
        }),
    ];
    (
        prop_oneof![Just(48 * MIB), Just(96 * MIB), Just(200 * MIB), Just(1u64 << 30)],
        prop_oneof![3 => Just(u64::MAX), 1 => Just(20 * MIB), 1 => Just(40 * MIB), 1 => Just(64 * MIB)],
        prop_oneof![3 => Just(20 * MIB), 1 => Just(40 * MIB)],
        prop_oneof![3 => Just(0.0), 1 => Just(0.5), 1 => Just(0.8)],
        divisions,
        prop_oneof![3 => Just(None), 1 => Just(Some(0.5)), 1 => Just(Some(0.8))],
        prop_oneof![2 => Just(false), 1 => Just(true)],
    )
        .prop_map(|(capacity, max_split_size, max_non_split_rounding_size, gc, roundup_power2_divisions, memory_fraction, expandable_segments)| Knobs {
            capacity,
            max_split_size,
            max_non_split_rounding_size,
            garbage_collection_threshold: gc,
            roundup_power2_divisions,
            memory_fraction,
            expandable_segments,
        })
}

/// Knobs for fuzzing, drawn from the same choices as [`knobs_strategy`] (small capped devices,
/// every setting varied) so that a fuzzer and the property tests explore the same space.
impl<'a> arbitrary::Arbitrary<'a> for Knobs {
    fn arbitrary(u: &mut arbitrary::Unstructured<'a>) -> arbitrary::Result<Knobs> {
        let capacity = *u.choose(&[48 * MIB, 96 * MIB, 200 * MIB, 1u64 << 30])?;
        let max_split_size =
            *u.choose(&[u64::MAX, u64::MAX, u64::MAX, 20 * MIB, 40 * MIB, 64 * MIB])?;
        let max_non_split_rounding_size = *u.choose(&[20 * MIB, 20 * MIB, 20 * MIB, 40 * MIB])?;
        let garbage_collection_threshold = *u.choose(&[0.0, 0.0, 0.0, 0.5, 0.8])?;
        let roundup_power2_divisions = match u.int_in_range(0u8..=5)? {
            0..=2 => [0u64; 16],
            3 => [4u64; 16],
            4 => [2u64; 16],
            _ => {
                let mut d = [8u64; 16];
                d[0] = 1;
                d[1] = 2;
                d
            }
        };
        let memory_fraction = *u.choose(&[None, None, None, Some(0.5), Some(0.8)])?;
        let expandable_segments = u.ratio(1u8, 3u8)?;
        Ok(Knobs {
            capacity,
            max_split_size,
            max_non_split_rounding_size,
            garbage_collection_threshold,
            roundup_power2_divisions,
            memory_fraction,
            expandable_segments,
        })
    }
}

/// A scenario: knobs and operations.
#[derive(Clone, Debug)]
pub struct Scenario {
    /// The settings and device.
    pub knobs: Knobs,
    /// The operations, in order.
    pub ops: Vec<Op>,
}

/// Scenarios of `len` operations.
pub fn scenario_strategy(len: std::ops::RangeInclusive<usize>) -> impl Strategy<Value = Scenario> {
    (
        knobs_strategy(),
        proptest::collection::vec(op_strategy(), len),
    )
        .prop_map(|(knobs, ops)| Scenario { knobs, ops })
}
