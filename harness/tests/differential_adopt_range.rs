//! Rule 18f, adopting a range of expandable segments: the allocator and the model agree on
//! hand-made ranges (with the figures the rule's text gives), on every kind of refusal, and on
//! random sequences that start from an adopted range.
//!
//! `PROPTEST_CASES` raises the number of sequences (default 300 here).

use cachalot_harness::driver::{Driver, run_scenario, run_scenario_observed};
use cachalot_harness::op::{
    ADOPT_REGION, AdoptBlockSpec, AdoptRaw, AdoptSpec, NO_FLAW, Op, build_range,
};
use cachalot_harness::scenario::{Knobs, Scenario, scenario_strategy};
use cachalot_harness::side::{Call, CoreSide, FlatStats, ModelSide, Outcome, stat_paths};
use proptest::prelude::*;

const MIB: u64 = 1 << 20;

fn cases() -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(300)
}

fn expandable(capacity: u64) -> Knobs {
    Knobs {
        expandable_segments: true,
        ..Knobs::pytorch(capacity)
    }
}

fn block(size: u64, state: u8, requested: u64, streams: Vec<u8>) -> AdoptBlockSpec {
    AdoptBlockSpec {
        size,
        state,
        requested,
        streams,
    }
}

fn unmapped(size: u64) -> AdoptBlockSpec {
    block(size, 3, 0, vec![])
}

fn free(size: u64) -> AdoptBlockSpec {
    block(size, 0, 0, vec![])
}

fn stat(seen: &FlatStats, name: &str) -> i128 {
    stat_paths(seen)
        .into_iter()
        .find(|(n, _)| n == name)
        .unwrap_or_else(|| panic!("no statistic {name}"))
        .1
}

/// The range of the first hand test: `[unmapped 20][alloc 8][free 12][unmapped 40]
/// [pending 6 on stream 1][free 14]`, MiB, then unmapped to the end (20 MiB pages).
fn hand_range() -> AdoptSpec {
    AdoptSpec {
        address: ADOPT_REGION,
        size: 0,
        stream: 0,
        small: false,
        blocks: vec![
            unmapped(20 * MIB),
            block(8 * MIB, 1, 8_000_000, vec![]),
            free(12 * MIB),
            unmapped(40 * MIB),
            block(6 * MIB, 2, 6 * MIB, vec![1]),
            free(14 * MIB),
        ],
    }
}

#[test]
fn an_adopted_range_counts_its_mapped_bytes_and_is_listed_run_by_run() {
    let seen = run_scenario_observed(&Scenario {
        knobs: expandable(1 << 30),
        ops: vec![Op::AdoptRange {
            range: hand_range(),
        }],
    })
    .unwrap();
    // Rule 18f's statistics: reserved = the mapped bytes (40 MiB), no segment, the allocated
    // block and the pending one active, nothing inactive split (rule 19d).
    let s = &seen.stats;
    assert_eq!(stat(s, "reserved_bytes.all.current"), (40 * MIB) as i128);
    assert_eq!(stat(s, "segment.all.current"), 0);
    assert_eq!(stat(s, "allocation.all.current"), 1);
    assert_eq!(stat(s, "allocated_bytes.all.current"), (8 * MIB) as i128);
    assert_eq!(stat(s, "active.all.current"), 2);
    assert_eq!(stat(s, "active_bytes.all.current"), (14 * MIB) as i128);
    assert_eq!(
        stat(s, "requested_bytes.all.current"),
        (8_000_000 + 6 * MIB) as i128
    );
    assert_eq!(stat(s, "inactive_split_bytes.all.current"), 0);
    assert_eq!(stat(s, "num_device_alloc"), 0);
    assert_eq!(seen.device_used, 40 * MIB);
    // Rule 19h: one segment per run of mapped blocks.
    let runs: Vec<(u64, u64, bool)> = seen
        .layout
        .iter()
        .map(|v| (v.address - ADOPT_REGION, v.size, v.expandable))
        .collect();
    assert_eq!(
        runs,
        vec![(20 * MIB, 20 * MIB, true), (80 * MIB, 20 * MIB, true)]
    );
}

#[test]
fn an_adopted_range_serves_best_fit_and_grows_into_its_gap() {
    // 10 MiB: best fit is the 12 MiB block at +28 MiB (rule 19a: the 14 MiB block reaches
    // farther). 30 MiB: no free block fits; rule 19b's start is the 2 MiB left free at +38 MiB
    // (the block before the 40 MiB gap: 2 + 40 ≥ 30), which one map step of 28 MiB, rounded
    // to two 20 MiB pages, grows to 42 MiB: handed out at +38 MiB. The range is then one run
    // of 80 MiB mapped, from +20 MiB.
    let seen = run_scenario_observed(&Scenario {
        knobs: expandable(1 << 30),
        ops: vec![
            Op::AdoptRange {
                range: hand_range(),
            },
            Op::Malloc {
                size: 10 * MIB,
                stream: 0,
            },
            Op::Malloc {
                size: 30 * MIB,
                stream: 0,
            },
        ],
    })
    .unwrap();
    let s = &seen.stats;
    assert_eq!(stat(s, "reserved_bytes.all.current"), (80 * MIB) as i128);
    assert_eq!(stat(s, "num_device_alloc"), 1);
    assert_eq!(stat(s, "segment.all.current"), 0);
    let runs: Vec<(u64, u64)> = seen
        .layout
        .iter()
        .map(|v| (v.address - ADOPT_REGION, v.size))
        .collect();
    assert_eq!(runs, vec![(20 * MIB, 80 * MIB)]);
    let blocks: Vec<(u64, u64, u64)> = seen.layout[0]
        .blocks
        .iter()
        .map(|b| (b.address - ADOPT_REGION, b.size, b.requested))
        .collect();
    assert_eq!(
        blocks,
        vec![
            (20 * MIB, 8 * MIB, 8_000_000),
            (28 * MIB, 10 * MIB, 10 * MIB),
            (38 * MIB, 30 * MIB, 30 * MIB),
            (68 * MIB, 12 * MIB, 0),
            (80 * MIB, 6 * MIB, 6 * MIB),
            (86 * MIB, 14 * MIB, 0),
        ]
    );
}

fn adopt(driver: &mut Driver<CoreSide, ModelSide>, range: &AdoptSpec) -> Outcome {
    let outcome = driver
        .call(&Call::Adopt {
            segment: range.resolve_range(),
        })
        .unwrap();
    driver.compare().unwrap();
    outcome
}

fn driver(knobs: &Knobs) -> Driver<CoreSide, ModelSide> {
    Driver::new(CoreSide::new(knobs).unwrap(), ModelSide::new(knobs))
}

#[test]
fn every_broken_layout_is_refused_by_both_and_changes_nothing() {
    for small in [false, true] {
        for units in [0u8, 1, 2, 4, 5] {
            let raw = |flaw| AdoptRaw {
                slot: 3,
                small,
                units,
                stream: 1,
                blocks: vec![(7, 3, 1, 1), (90_000, 6, 2, 5), (5, 0, 0, 0)],
                flaw,
            };
            let mut d = driver(&expandable(1 << 30));
            for flaw in 0..NO_FLAW {
                let outcome = adopt(&mut d, &build_range(&raw(flaw)));
                assert_eq!(
                    outcome,
                    Outcome::InvalidAdoption,
                    "flaw {flaw}, small {small}, units {units}: {:?}",
                    build_range(&raw(flaw))
                );
            }
            // The valid one is taken, and then overlaps itself.
            let valid = build_range(&raw(NO_FLAW));
            assert_eq!(adopt(&mut d, &valid), Outcome::Ok(0), "{valid:?}");
            assert_eq!(adopt(&mut d, &valid), Outcome::InvalidAdoption);
            // So does a segment (rule 18) inside the range.
            let segment = AdoptSpec {
                address: valid.address + 200 * MIB,
                size: 20 * MIB,
                stream: 0,
                small: false,
                blocks: vec![free(20 * MIB)],
            };
            let outcome = d
                .call(&Call::Adopt {
                    segment: segment.resolve(),
                })
                .unwrap();
            assert_eq!(outcome, Outcome::InvalidAdoption);
            d.drain().unwrap();
        }
    }
}

#[test]
fn ranges_are_refused_without_expandable_segments_and_beyond_the_capacity() {
    let mut d = driver(&Knobs::pytorch(1 << 30));
    assert_eq!(adopt(&mut d, &hand_range()), Outcome::InvalidAdoption);
    // 64 MiB of capacity: the range is 80 MiB (rule 19: 20 MiB × ⌈72 / 20⌉), wholly mapped.
    let mut d = driver(&expandable(64 * MIB));
    let full = AdoptSpec {
        blocks: vec![free(80 * MIB)],
        ..hand_range()
    };
    assert_eq!(adopt(&mut d, &full), Outcome::AdoptionOutOfMemory);
    // One more block than the range holds is refused before the device is asked.
    let over = AdoptSpec {
        blocks: vec![free(80 * MIB), unmapped(20 * MIB)],
        ..hand_range()
    };
    assert_eq!(adopt(&mut d, &over), Outcome::InvalidAdoption);
    let fits = AdoptSpec {
        blocks: vec![free(60 * MIB)],
        ..hand_range()
    };
    assert_eq!(adopt(&mut d, &fits), Outcome::Ok(0));
    d.drain().unwrap();
}

#[test]
fn a_pending_block_of_an_adopted_range_waits_for_its_stream() {
    // 12 MiB takes the free 12 MiB block at +28. While the pending 6 MiB block waits for
    // stream 1, 18 MiB fits no free block: rule 19b's first start is the unmapped 20 MiB at
    // +0, mapped as one page. Once stream 1's work is done, the pending block returns (rule 5)
    // and merges with the free 14 MiB after it: the next 18 MiB is served at +80, no growth.
    let malloc = |size| Op::Malloc { size, stream: 0 };
    let seen = run_scenario_observed(&Scenario {
        knobs: expandable(1 << 30),
        ops: vec![
            Op::AdoptRange {
                range: hand_range(),
            },
            malloc(12 * MIB),
            malloc(18 * MIB),
            Op::CompleteStream { stream: 1 },
            malloc(18 * MIB),
        ],
    })
    .unwrap();
    let at = |requested| -> Vec<u64> {
        seen.layout
            .iter()
            .flat_map(|v| v.blocks.iter())
            .filter(|b| b.requested == requested)
            .map(|b| b.address - ADOPT_REGION)
            .collect()
    };
    assert_eq!(at(12 * MIB), vec![28 * MIB]);
    assert_eq!(at(18 * MIB), vec![0, 80 * MIB]);
    assert_eq!(
        stat(&seen.stats, "reserved_bytes.all.current"),
        (60 * MIB) as i128
    );
    assert_eq!(stat(&seen.stats, "num_device_alloc"), 1);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), max_shrink_iters: 20_000, ..ProptestConfig::default() })]

    /// Random sequences under expandable segments that start with a range adoption (and may
    /// adopt more along the way).
    #[test]
    fn allocator_agrees_with_model_from_adopted_ranges(
        scenario in scenario_strategy(60..=160),
        raw in (any::<u8>(), any::<bool>(), any::<u8>(), 0u8..3,
                proptest::collection::vec(any::<(u32, u8, u32, u8)>(), 0..=5)),
    ) {
        let (slot, small, units, stream, blocks) = raw;
        let first = build_range(&AdoptRaw { slot, small, units, stream, blocks, flaw: NO_FLAW });
        let mut ops = vec![Op::AdoptRange { range: first }];
        ops.extend(scenario.ops);
        let s = Scenario {
            knobs: Knobs { expandable_segments: true, ..scenario.knobs },
            ops,
        };
        if let Err(e) = run_scenario(&s) {
            prop_assert!(false, "{e}\nknobs: {:?}\nops ({}): {:?}", s.knobs, s.ops.len(), s.ops);
        }
    }
}
