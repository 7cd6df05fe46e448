//! The allocator agrees with the reference model on every observable outcome, for random
//! operation sequences under varied settings on small, capped devices.
//!
//! `PROPTEST_CASES` raises the number of sequences for long campaigns (default 1000 here).

use cachalot_harness::driver::run_scenario;
use cachalot_harness::op::Op;
use cachalot_harness::scenario::{Knobs, Scenario, scenario_strategy};
use proptest::prelude::*;

fn cases() -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1000)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), max_shrink_iters: 20_000, ..ProptestConfig::default() })]

    #[test]
    fn allocator_agrees_with_model_on_random_sequences(scenario in scenario_strategy(100..=250)) {
        if let Err(e) = run_scenario(&scenario) {
            prop_assert!(false, "{e}\nknobs: {:?}\nops ({}): {:?}", scenario.knobs, scenario.ops.len(), scenario.ops);
        }
    }
}

const MIB: u64 = 1 << 20;

fn run(knobs: Knobs, ops: Vec<Op>) {
    let s = Scenario { knobs, ops };
    if let Err(e) = run_scenario(&s) {
        panic!("{e}");
    }
}

#[test]
fn cross_stream_frees_wait_for_their_events_in_both() {
    use Op::*;
    run(
        Knobs::pytorch(1 << 30),
        vec![
            Malloc {
                size: 4 * MIB,
                stream: 0,
            },
            RecordStream { pick: 0, stream: 1 },
            Free { pick: 0 },
            Malloc {
                size: 4 * MIB,
                stream: 0,
            },
            CompleteStream { stream: 1 },
            Malloc {
                size: 4 * MIB,
                stream: 0,
            },
        ],
    );
}

#[test]
fn out_of_memory_and_the_retry_path_agree_in_both() {
    use Op::*;
    run(
        Knobs {
            max_split_size: 40 * MIB,
            ..Knobs::pytorch(96 * MIB)
        },
        vec![
            Malloc {
                size: 60 * MIB,
                stream: 0,
            },
            Free { pick: 0 },
            Malloc {
                size: 30 * MIB,
                stream: 1,
            },
            Malloc {
                size: 50 * MIB,
                stream: 1,
            },
            Malloc {
                size: 90 * MIB,
                stream: 2,
            },
            FailDeviceAllocs { n: 2 },
            Malloc {
                size: 512,
                stream: 0,
            },
        ],
    );
}

#[test]
fn adopted_layouts_agree_in_both() {
    use Op::*;
    use cachalot_harness::op::{ADOPT_REGION, AdoptBlockSpec, AdoptSpec};
    let block = |size, state, requested, streams: Vec<u8>| AdoptBlockSpec {
        size,
        state,
        requested,
        streams,
    };
    let small = AdoptSpec {
        address: ADOPT_REGION + 62 * MIB,
        size: 2 * MIB,
        stream: 0,
        small: true,
        blocks: vec![
            block(4096, 1, 4000, vec![]),
            block(MIB - 4096, 0, 0, vec![]),
            block(MIB, 2, 700, vec![1, 2]),
        ],
    };
    // Ends at the device's base address: placement must go around it.
    let large = AdoptSpec {
        address: ADOPT_REGION + 64 * MIB,
        size: 20 * MIB,
        stream: 1,
        small: false,
        blocks: vec![
            block(4 * MIB, 0, 0, vec![]),
            block(16 * MIB, 1, 15 * MIB, vec![]),
        ],
    };
    run(
        Knobs::pytorch(1 << 30),
        vec![
            Adopt { segment: small },
            Adopt { segment: large },
            SetNextAddress {
                address: Some(ADOPT_REGION + 86 * MIB),
            },
            Malloc {
                size: 3 * MIB,
                stream: 1,
            },
            Malloc {
                size: 3 * MIB,
                stream: 1,
            },
            Malloc {
                size: 100,
                stream: 0,
            },
            RecordStream { pick: 0, stream: 2 },
            Free { pick: 0 },
            CompleteStream { stream: 1 },
            Malloc {
                size: 100,
                stream: 0,
            },
            CompleteStream { stream: 2 },
            Malloc {
                size: MIB,
                stream: 0,
            },
            EmptyCache,
        ],
    );
}

#[test]
fn the_adoption_strategy_makes_valid_and_invalid_layouts() {
    use cachalot_harness::draw::strategy;
    use cachalot_harness::driver::Driver;
    use cachalot_harness::op::AdoptSpec;
    use cachalot_harness::side::{CoreSide, ModelSide, Side};
    use proptest::strategy::ValueTree;
    use proptest::test_runner::TestRunner;
    let mut runner = TestRunner::deterministic();
    let (mut adopted, mut refused, mut blocks) = (0, 0, 0);
    let knobs = Knobs::pytorch(1 << 30);
    for _ in 0..300 {
        let segment = strategy::<AdoptSpec>()
            .new_tree(&mut runner)
            .unwrap()
            .current();
        let mut d = Driver::new(CoreSide::new(&knobs).unwrap(), ModelSide::new(&knobs));
        let n = segment.blocks.len();
        d.apply(&Op::Adopt { segment }).unwrap();
        if d.a.observe().unwrap().layout.is_empty() {
            refused += 1;
        } else {
            adopted += 1;
            blocks += n;
        }
    }
    assert!(
        adopted > 200 && refused > 30,
        "{adopted} adopted, {refused} refused"
    );
    assert!(
        blocks > 2 * adopted,
        "{blocks} blocks in {adopted} segments"
    );
}

#[test]
fn scripted_addresses_agree_in_both_unusable_ones_skipped() {
    use Op::*;
    use cachalot_harness::driver::Driver;
    use cachalot_harness::op::{ADOPT_REGION, AdoptBlockSpec, AdoptSpec};
    use cachalot_harness::side::{CoreSide, ModelSide, Side};
    let segment = AdoptSpec {
        address: ADOPT_REGION + 20 * MIB,
        size: 20 * MIB,
        stream: 0,
        small: false,
        blocks: vec![AdoptBlockSpec {
            size: 20 * MIB,
            state: 1,
            requested: 20 * MIB,
            streams: vec![],
        }],
    };
    let knobs = Knobs {
        address_script: vec![
            0,                       // null: skipped
            ADOPT_REGION + 256,      // not a multiple of 512: skipped
            ADOPT_REGION + 30 * MIB, // inside the adopted segment: skipped
            u64::MAX - 511,          // overflows: skipped
            ADOPT_REGION,            // usable: taken
            ADOPT_REGION + 2 * MIB,  // usable: taken by the next one
        ],
        ..Knobs::pytorch(1 << 30)
    };
    let mut d = Driver::new(CoreSide::new(&knobs).unwrap(), ModelSide::new(&knobs));
    d.apply(&Adopt { segment }).unwrap();
    for stream in 0..3 {
        d.apply(&Malloc { size: 512, stream }).unwrap();
    }
    let segments: Vec<u64> =
        d.a.observe()
            .unwrap()
            .layout
            .iter()
            .map(|s| s.address)
            .collect();
    assert_eq!(
        segments,
        [
            ADOPT_REGION,
            ADOPT_REGION + 2 * MIB,
            ADOPT_REGION + 20 * MIB,
            0x7f00_0000_0000
        ]
    );
    d.drain().unwrap();
}

#[test]
fn null_addresses_are_answered_alike() {
    use Op::*;
    // A raw foreign address of 0 is the null address: freeing it is a no-op in both, and
    // `record_stream` on it must get the same answer from both.
    run(
        Knobs::pytorch(1 << 30),
        vec![
            FreeForeign { address: 0 },
            RecordStreamForeign {
                address: 0,
                stream: 1,
            },
            Malloc {
                size: 512,
                stream: 0,
            },
            FreeForeign { address: 0 },
            RecordStreamForeign {
                address: 0,
                stream: 0,
            },
        ],
    );
}
