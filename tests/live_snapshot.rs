//! A live snapshot from a Rust program: a workload on the thread-safe `Allocator` (simulated
//! device, cachalot's default settings with thread caches, two threads, two streams with
//! cross-stream frees, an `empty_cache`) records its history in a ring that wraps — recording
//! began mid-run and the ring kept only the last entries — and writes a PyTorch snapshot. Read
//! back with cachalot's reader and replayed from the state rebuilt from the dump, it gives the
//! allocator's own figures: peak reserved and peak allocated over the window, the final
//! statistics, and the final layout block for block.

use cachalot::{Allocator, HistoryOptions, SegmentInfo, Settings, SimDevice, StreamId};
use cachalot_tools::replay::{
    ReplayConfig, ReplayOptions, ReplayOutcome, SnapshotExt, StartMode, replay, replay_ops_from,
};
use cachalot_tools::selfcheck::check_final_state;
use cachalot_tools::snapshot::{Snapshot, parse_snapshot, write_snapshot};
use rand::rngs::Xoshiro256PlusPlus;
use rand::{RngExt, SeedableRng};

const MIB: u64 = 1 << 20;
const RING: usize = 600;
const SIDE: StreamId = StreamId(7);

/// Allocates and frees at random on `stream`, keeping at most `keep` blocks; sizes up to
/// `max` bytes. Every few steps a block is used on the side stream before its free (its free
/// then waits for that stream, which completes later).
fn churn(
    alloc: &Allocator<SimDevice>,
    rng: &mut Xoshiro256PlusPlus,
    stream: StreamId,
    steps: usize,
    keep: usize,
    max: u64,
    live: &mut Vec<u64>,
) {
    for step in 0..steps {
        if live.len() < keep && rng.random_range(0..3) > 0 {
            let size = match rng.random_range(0..4) {
                0 => rng.random_range(1..4096),
                1 => rng.random_range(4096..MIB),
                _ => rng.random_range(MIB..max),
            };
            live.push(alloc.malloc(size, stream).unwrap());
        } else if !live.is_empty() {
            let p = live.swap_remove(rng.random_range(0..live.len()));
            if step % 7 == 0 {
                alloc.record_stream(p, SIDE).unwrap();
            }
            alloc.free(p).unwrap();
        }
        if step % 50 == 0 {
            alloc.with_backend(|d| d.complete_stream(SIDE));
        }
    }
}

/// The program: a warm-up before recording, churn on two threads and two streams that wraps
/// the ring, an `empty_cache`, then (peaks reset) a final phase that reaches the peak.
fn program() -> (Allocator<SimDevice>, Snapshot) {
    // cachalot's policy on segments: a recording that begins mid-run is rebuilt block for
    // block for segments, not yet for expandable segments' ranges (ARCHITECTURE, rule 19g).
    let settings = Settings::parse("expandable_segments:False").unwrap();
    let alloc = Allocator::new(SimDevice::new(64 << 30), settings).unwrap();
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(11);
    let mut main_live = Vec::new();
    // Warm-up, not recorded: the process holds segments, live blocks and cached ones.
    churn(
        &alloc,
        &mut rng,
        StreamId(0),
        300,
        40,
        24 * MIB,
        &mut main_live,
    );

    alloc.record_history_with(Some(HistoryOptions::new(RING)));
    let worker = alloc.clone();
    std::thread::spawn(move || {
        let mut rng = Xoshiro256PlusPlus::seed_from_u64(12);
        let mut live = Vec::new();
        churn(&worker, &mut rng, StreamId(3), 400, 20, 8 * MIB, &mut live);
        for p in live {
            worker.free(p).unwrap();
        }
    })
    .join()
    .unwrap();
    churn(
        &alloc,
        &mut rng,
        StreamId(0),
        800,
        40,
        24 * MIB,
        &mut main_live,
    );
    alloc.with_backend(|d| d.complete_stream(SIDE));
    alloc.empty_cache().unwrap();

    // The last phase fits in the ring and goes higher than anything before it.
    alloc.reset_peak_stats();
    let big: Vec<u64> = (0..6)
        .map(|i| alloc.malloc((200 + 30 * i) * MIB, StreamId(0)).unwrap())
        .collect();
    churn(
        &alloc,
        &mut rng,
        StreamId(0),
        60,
        45,
        24 * MIB,
        &mut main_live,
    );
    for &p in &big[..3] {
        alloc.free(p).unwrap();
    }
    // One free still waits for the side stream at the dump (an active_pending_free block).
    let pending = alloc.malloc(3 * MIB, StreamId(0)).unwrap();
    alloc.record_stream(pending, SIDE).unwrap();
    alloc.free(pending).unwrap();

    let snapshot = alloc.snapshot();
    (alloc, snapshot)
}

fn replay_snapshot(snapshot: &Snapshot, start_mode: StartMode) -> ReplayOutcome {
    let recorded = snapshot.allocator_settings.as_ref().unwrap();
    let options = ReplayOptions::from_settings(Some(recorded));
    let start = snapshot
        .start_of(0)
        .expect("the start rebuilds from the dump");
    assert!(
        !start.is_fresh(),
        "recording began mid-run: the start holds segments"
    );
    let (program, conversion) = replay_ops_from(&snapshot.traces[0], &options, &start);
    assert_eq!(conversion.unmatched_frees, 0);
    let config = ReplayConfig {
        settings: Settings::pytorch().apply(&recorded.alloc_conf).unwrap(),
        start: start_mode,
        ..ReplayConfig::pytorch()
    };
    replay(&program, &config).unwrap()
}

/// What must agree: the peaks since the reset (the last phase holds them), the final
/// statistics and the layout.
fn differences(out: &ReplayOutcome, alloc: &Allocator<SimDevice>) -> Vec<String> {
    let stats = alloc.stats();
    let mut diffs = Vec::new();
    let mut check = |what: &str, replayed: u64, own: i64| {
        if replayed != own as u64 {
            diffs.push(format!("{what}: replay {replayed}, allocator {own}"));
        }
    };
    check(
        "peak reserved",
        out.peak_reserved_bytes,
        stats.reserved_bytes.all.peak,
    );
    check(
        "peak allocated",
        out.peak_allocated_bytes,
        stats.allocated_bytes.all.peak,
    );
    check(
        "reserved now",
        out.stats.reserved_bytes.all.current as u64,
        stats.reserved_bytes.all.current,
    );
    check(
        "allocated now",
        out.stats.allocated_bytes.all.current as u64,
        stats.allocated_bytes.all.current,
    );
    let own: Vec<SegmentInfo> = alloc.segments();
    if out.final_layout != own {
        diffs.push("final layout differs".into());
    }
    diffs
}

#[test]
fn a_rust_programs_live_snapshot_replays_to_its_own_figures() {
    let (alloc, snapshot) = program();
    let mut bytes = Vec::new();
    write_snapshot(&snapshot, &mut bytes).unwrap();
    // CACHALOT_LIVE_SNAPSHOT_OUT=FILE keeps the snapshot (for `cachalot replay FILE`).
    if let Some(path) = std::env::var_os("CACHALOT_LIVE_SNAPSHOT_OUT") {
        std::fs::write(path, &bytes).unwrap();
    }
    let back = parse_snapshot(&bytes).unwrap();
    assert_eq!(back, snapshot, "the snapshot reads back as written");

    // The ring wrapped: it holds exactly its size, and the window begins mid-run.
    let trace = &back.traces[0].entries;
    assert_eq!(trace.len(), RING);
    assert!(trace.windows(2).all(|w| w[0].time_us <= w[1].time_us));
    assert!(
        back.segments
            .iter()
            .flat_map(|s| &s.blocks)
            .any(|b| b.state.as_str() == "active_pending_free")
    );

    let out = replay_snapshot(&back, StartMode::Exact);
    let stats = alloc.stats();
    println!(
        "allocator: peak reserved {}, peak allocated {}, reserved {}, segments {}",
        stats.reserved_bytes.all.peak,
        stats.allocated_bytes.all.peak,
        stats.reserved_bytes.all.current,
        alloc.segments().len()
    );
    assert_eq!(differences(&out, &alloc), Vec::<String>::new());
    // The tools' own self-check agrees: the replay ends in the dumped state.
    let check = check_final_state(&out.final_layout, &back, 0);
    assert!(check.matches, "{:?}", check.first_difference);
    // The peak is really in the window (the final phase), well above the warm-up's.
    assert!(out.peak_reserved_bytes > 1200 * MIB);

    // The comparison can fail: the same trace replayed without the state the process held
    // when recording began does not give the allocator's figures.
    let wrong = replay_snapshot(&back, StartMode::Empty);
    assert!(!differences(&wrong, &alloc).is_empty());
}

#[test]
fn recording_bypasses_thread_caches_so_every_allocation_is_in_the_history() {
    // cachalot's defaults keep freed blocks in thread caches; a cache hit never reaches the
    // core. While recording, every malloc and free is recorded as the program made it.
    let alloc = Allocator::new(SimDevice::new(1 << 30), Settings::default()).unwrap();
    let p = alloc.malloc(4096, StreamId(0)).unwrap();
    alloc.free(p).unwrap(); // parked in this thread's cache
    assert_eq!(alloc.thread_cached_blocks(), 1);
    alloc.record_history(Some(1000));
    assert_eq!(
        alloc.thread_cached_blocks(),
        0,
        "recording flushes the caches"
    );
    for _ in 0..3 {
        let p = alloc.malloc(4096, StreamId(0)).unwrap();
        alloc.free(p).unwrap();
    }
    let history = alloc.history();
    let count = |a: cachalot::TraceAction| history.iter().filter(|e| e.action == a).count();
    assert_eq!(count(cachalot::TraceAction::Alloc), 3);
    assert_eq!(count(cachalot::TraceAction::FreeRequested), 3);
    // Stopped, the caches are back.
    alloc.record_history(None);
    let p = alloc.malloc(4096, StreamId(0)).unwrap();
    alloc.free(p).unwrap();
    assert_eq!(alloc.thread_cached_blocks(), 1);
    alloc.check_invariants().unwrap();
}
