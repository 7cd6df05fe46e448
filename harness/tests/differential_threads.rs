//! The thread-safe front end, driven from real threads, agrees with the reference model's
//! rule 17 (thread caches) on every observable outcome — and, with thread caches off, with the
//! plain model: PyTorch's decisions.
//!
//! `PROPTEST_CASES` raises the number of sequences for long campaigns (default 200 here).

use cachalot_harness::driver::run_thread_scenario;
use cachalot_harness::op::{Op, ThreadOp};
use cachalot_harness::scenario::{Knobs, ThreadScenario, thread_scenario_strategy};
use proptest::prelude::*;

fn cases() -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(200)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), max_shrink_iters: 5_000, ..ProptestConfig::default() })]

    #[test]
    fn front_end_agrees_with_model_on_random_threaded_sequences(scenario in thread_scenario_strategy(50..=200)) {
        if let Err(e) = run_thread_scenario(&scenario) {
            prop_assert!(false, "{e}\nknobs: {:?}\nops ({}): {:?}",
                scenario.knobs, scenario.ops.len(), scenario.ops);
        }
    }
}

/// Sequences where thread caches mostly miss: requests of many sizes (a small cache's
/// blocks leave it full again and again, rule 17b), with now and then a size freed a moment
/// ago (a hit), on two threads.
fn churn_ops() -> impl Strategy<Value = Vec<ThreadOp>> {
    let malloc = |(thread, k): (u8, u64)| ThreadOp::On {
        thread,
        op: Op::Malloc {
            size: k * 512,
            stream: 0,
        },
    };
    proptest::collection::vec(
        prop_oneof![
            5 => (0u8..2, 1u64..=200).prop_map(malloc),
            2 => (0u8..2, 1u64..=3).prop_map(malloc),
            6 => (0u8..2, any::<u16>()).prop_map(|(thread, pick)| ThreadOp::FreeOwn { thread, pick }),
        ],
        100..=400,
    )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases() / 2, max_shrink_iters: 5_000, ..ProptestConfig::default() })]

    /// Rule 17b's overflow, again and again: caches of one and two blocks that mostly miss
    /// agree with the model.
    #[test]
    fn caches_that_mostly_miss_agree_with_model(blocks in 1u32..=2, ops in churn_ops()) {
        let scenario = ThreadScenario {
            knobs: Knobs { thread_cache_blocks: blocks, ..Knobs::pytorch(1 << 30) },
            ops,
        };
        if let Err(e) = run_thread_scenario(&scenario) {
            prop_assert!(false, "{e}\nblocks: {blocks}\nops ({}): {:?}", scenario.ops.len(), scenario.ops);
        }
    }
}

const MIB: u64 = 1 << 20;

fn run(thread_cache_blocks: u32, knobs: Knobs, ops: Vec<ThreadOp>) {
    let s = ThreadScenario {
        knobs: Knobs {
            thread_cache_blocks,
            ..knobs
        },
        ops,
    };
    if let Err(e) = run_thread_scenario(&s) {
        panic!("{e}");
    }
}

fn on(thread: u8, op: Op) -> ThreadOp {
    ThreadOp::On { thread, op }
}

#[test]
fn a_freed_block_comes_back_to_its_thread_and_a_double_free_is_refused() {
    use Op::*;
    for n in [0, 1, 8] {
        run(
            n,
            Knobs::pytorch(1 << 30),
            vec![
                on(
                    0,
                    Malloc {
                        size: 4096,
                        stream: 0,
                    },
                ),
                on(0, Free { pick: 0 }),
                on(1, FreeForeign { address: 0 }), // the address just freed, on another thread
                on(0, FreeForeign { address: 0 }), // and on its own
                on(
                    1,
                    Malloc {
                        size: 4096,
                        stream: 0,
                    },
                ),
                on(
                    0,
                    Malloc {
                        size: 4096,
                        stream: 0,
                    },
                ),
                ThreadOp::Flush { thread: 0 },
                ThreadOp::Retire { thread: 1 },
            ],
        );
    }
}

#[test]
fn out_of_memory_flushes_every_thread_cache_before_failing() {
    use Op::*;
    run(
        8,
        Knobs::pytorch(48 * MIB),
        vec![
            on(
                0,
                Malloc {
                    size: 20 * MIB,
                    stream: 0,
                },
            ),
            on(
                1,
                Malloc {
                    size: 20 * MIB,
                    stream: 0,
                },
            ),
            on(0, Free { pick: 0 }),
            on(1, Free { pick: 0 }),
            // 40 MiB reserved and kept by two threads: the next large request needs them back.
            on(
                2,
                Malloc {
                    size: 30 * MIB,
                    stream: 1,
                },
            ),
        ],
    );
}

#[test]
fn a_block_used_on_another_stream_is_never_kept() {
    use Op::*;
    run(
        8,
        Knobs::pytorch(1 << 30),
        vec![
            on(
                0,
                Malloc {
                    size: 4 * MIB,
                    stream: 0,
                },
            ),
            on(0, RecordStream { pick: 0, stream: 1 }),
            on(0, Free { pick: 0 }),
            on(
                0,
                Malloc {
                    size: 4 * MIB,
                    stream: 0,
                },
            ),
            on(1, CompleteStream { stream: 1 }),
            on(
                0,
                Malloc {
                    size: 4 * MIB,
                    stream: 0,
                },
            ),
        ],
    );
}
