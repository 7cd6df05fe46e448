//! The allocator agrees with the reference model on every observable outcome, for random
//! operation sequences under varied settings on small, capped devices.
//!
//! `PROPTEST_CASES` raises the number of sequences for long campaigns (default 1000 here).

use cachalot_tools::differential::run_scenario;
use cachalot_tools::op::Op;
use cachalot_tools::scenario::{Knobs, Scenario, scenario_strategy};
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
