//! The side-by-side benchmark (`cachalot_tools::bench`, the program `gpu_compare`) without a
//! GPU (`--backend sim`, what CI runs): on a committed program (`tests/fixtures/ops/two_stream.ops`,
//! written by `cachalot replay --pytorch --ops-out`, with held-back frees) it writes one valid
//! `cachalot gpu-bench v1` object per allocator and hot loop, whose figures agree with the
//! program itself; bad command lines and missing ops files are refused with a clear message
//! naming the option or the file, never a panic (malformed ops files: tests/ops_out.rs).

use std::path::{Path, PathBuf};
use std::process::Command;

use cachalot_tools::bench::error::Failure;
use cachalot_tools::bench::gpu_compare::run;
use cachalot_tools::bench::options::Options;
use cachalot_tools::bench::record::{HotLoop, TraceRun, downsample};
use clap::Parser;

const TWO_STREAM: &str = include_str!("fixtures/ops/two_stream.ops");

fn scratch(test: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "cachalot-gpu-compare-sim-{}-{test}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn options(list: &[&str]) -> Result<Options, clap::Error> {
    Options::try_parse_from(std::iter::once("gpu_compare").chain(list.iter().copied()))
}

/// A run file: its record, after checking its schema and kind.
fn read<T: serde::de::DeserializeOwned>(path: &Path, kind: &str) -> T {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let value: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(
        value["schema"],
        "cachalot gpu-bench v1",
        "{}",
        path.display()
    );
    assert_eq!(value["kind"], kind, "{}", path.display());
    // Only a failed run names an error.
    assert!(value.get("error").is_none(), "{}", path.display());
    serde_json::from_value(value).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// What the program itself says, counted here without the benchmark's interpreter: the lines
/// after `s`, its `a` lines, and the peak of live requested bytes (a free held back by an `r`
/// line no longer counts, as the benchmark counts it).
fn program_figures(text: &str) -> (u64, u64, u64) {
    let mut after_s = false;
    let (mut lines, mut allocs) = (0u64, 0u64);
    let mut live = std::collections::HashMap::new();
    let (mut requested, mut peak) = (0u64, 0u64);
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let f: Vec<u64> = line
            .split(' ')
            .skip(1)
            .map(|n| n.parse().unwrap())
            .collect();
        match line.as_bytes()[0] {
            b's' => {
                after_s = true;
                continue;
            }
            b'a' => {
                live.insert(f[0], f[1]);
                requested += f[1];
                allocs += u64::from(after_s);
            }
            b'f' => requested -= live.remove(&f[0]).unwrap_or(0),
            _ => {}
        }
        if after_s {
            lines += 1;
            peak = peak.max(requested);
        }
    }
    (lines, allocs, peak)
}

#[test]
fn the_simulated_run_writes_one_valid_result_per_allocator_and_hot_loop() {
    let dir = scratch("run");
    let ops = dir.join("two_stream.ops");
    std::fs::write(&ops, TWO_STREAM).unwrap();
    let out = dir.join("out");
    let o = options(&[
        "--backend",
        "sim",
        "--out",
        out.to_str().unwrap(),
        "--passes",
        "2",
        "--hot-pairs",
        "4000",
        ops.to_str().unwrap(),
    ])
    .unwrap();
    run(&o).unwrap_or_else(|e| panic!("gpu_compare failed: {e}"));

    let (lines, allocs, peak_requested) = program_figures(TWO_STREAM);
    assert!(lines > 0 && allocs > 0 && peak_requested > 0);
    let mut files: Vec<String> = std::fs::read_dir(out.join("runs"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
        .collect();
    files.sort();
    // The pool and cuMemAlloc need a GPU: nothing is written for them.
    assert_eq!(
        files,
        [
            "cachalot-expandable__hot__allocator.json",
            "cachalot-expandable__two_stream.json",
            "cachalot-pytorch__hot__allocator.json",
            "cachalot-pytorch__two_stream.json",
            "cachalot__hot__allocator.json",
            "cachalot__two_stream.json",
        ]
    );
    for allocator in ["cachalot-pytorch", "cachalot-expandable", "cachalot"] {
        let r: TraceRun = read(
            &out.join("runs")
                .join(format!("{allocator}__two_stream.json")),
            "trace",
        );
        assert_eq!(r.allocator, allocator);
        assert_eq!(r.trace, "two_stream");
        assert_eq!((r.lines, r.total_lines), (lines, lines));
        assert_eq!(r.allocs, allocs);
        assert_eq!(r.ooms, 0);
        assert_eq!(r.peak_requested, peak_requested);
        assert!(r.peak_reserved >= r.peak_requested, "{allocator}");
        let allocated = r
            .peak_allocated
            .expect("cachalot tells its allocated bytes");
        assert!(allocated >= r.peak_requested && allocated <= r.peak_reserved);
        let ratio = r.peak_reserved as f64 / r.peak_requested as f64;
        assert!((r.ratio.unwrap() - ratio).abs() < 1e-12);
        let calls = r.driver_calls.expect("cachalot counts its driver calls");
        assert!(calls > 0 && r.driver_calls_detail.is_some());
        let hits = r.cache_hits.expect("cache hits counted");
        assert!(hits <= r.allocs && r.reserved_changes.expect("changes counted") > 0);
        assert!((r.hit_rate.unwrap() - hits as f64 / r.allocs as f64).abs() < 1e-12);
        assert_eq!(r.passes, 2);
        assert!(r.ns_per_op_first.unwrap() > 0.0 && r.ns_per_op_steady.unwrap() > 0.0);
        // Fewer lines than points allowed: one point after `s` and one after each line.
        let t = r.timeline.as_ref().expect("a timeline");
        assert_eq!(t.line, (0..=lines).collect::<Vec<_>>());
        assert_eq!(t.requested.len() as u64, lines + 1);
        assert_eq!(t.requested.iter().max(), Some(&r.peak_requested));
        assert_eq!(t.reserved.iter().max(), Some(&r.peak_reserved));
        assert!(r.notes.as_deref().unwrap().contains("simulated"));
        assert_eq!(r.error, None);

        let h: HotLoop = read(
            &out.join("runs")
                .join(format!("{allocator}__hot__allocator.json")),
            "hot_loop",
        );
        assert_eq!(h.path, "allocator");
        assert_eq!(h.size, 1 << 20);
        assert_eq!(h.threads, [1, 2, 4, 8]);
        assert_eq!(h.pairs_per_thread, [4000, 2000, 1000, 500]);
        for (i, &t) in h.threads.iter().enumerate() {
            assert!(h.wall_ns_per_pair[i] > 0.0);
            let per_thread = h.wall_ns_per_pair[i] * t as f64;
            assert!((h.ns_per_pair_per_thread[i] - per_thread).abs() < 1e-6 * per_thread);
        }
    }
}

/// Rule 19j through the benchmark's device wrapper (held-back frees over the backend): a
/// setting that maps large steps as one handle runs, and makes fewer handles than one per page
/// for no fewer bytes (the wrapper once refused `map_handle`, as its default does).
#[test]
fn handles_of_several_pages_run_through_the_benchmarks_device() {
    let dir = scratch("handles");
    let ops = dir.join("two_stream.ops");
    std::fs::write(&ops, TWO_STREAM).unwrap();
    let mut runs = Vec::new();
    for config in [
        "expandable_page_mb:2",
        "expandable_page_mb:2,expandable_handle_mb:2",
    ] {
        let out = dir.join(config.replace([':', ','], "_"));
        let o = options(&[
            "--backend",
            "sim",
            "--out",
            out.to_str().unwrap(),
            "--passes",
            "2",
            "--no-hot",
            "--only",
            "cachalot",
            "--cachalot-config",
            config,
            ops.to_str().unwrap(),
        ])
        .unwrap();
        run(&o).unwrap_or_else(|e| panic!("gpu_compare with {config} failed: {e}"));
        let r: TraceRun = read(&out.join("runs").join("cachalot__two_stream.json"), "trace");
        assert_eq!(r.ooms, 0, "{config}");
        runs.push(r);
    }
    // The same program either way; no fewer bytes held with handles of several pages, and
    // fewer handles made (the detail names them: "map steps N (H handles)").
    assert_eq!(runs[0].peak_requested, runs[1].peak_requested);
    assert!(runs[1].peak_reserved >= runs[0].peak_reserved);
    let handles = |r: &TraceRun| -> u64 {
        let detail = r.driver_calls_detail.as_deref().expect("a detail");
        let (_, after) = detail.split_once("map steps ").expect("map steps named");
        let (_, after) = after.split_once('(').expect("handles named");
        after.split(' ').next().unwrap().parse().expect("a number")
    };
    let (per_page, per_step) = (handles(&runs[0]), handles(&runs[1]));
    assert!(
        per_step > 0 && per_step < per_page,
        "{per_page} vs {per_step}"
    );
}

#[test]
fn the_timeline_keeps_at_most_1000_points_each_its_buckets_maximum() {
    let points: Vec<(u64, u64, u64)> = (0..2500)
        .map(|i| (i, (i * 7919) % 1000, (i * 104_729) % 5000))
        .collect();
    let t = downsample(&points);
    assert!(
        t.line.len() <= 1000 && t.line.len() >= 500,
        "{}",
        t.line.len()
    );
    assert_eq!(t.requested.len(), t.line.len());
    assert_eq!(t.reserved.len(), t.line.len());
    // Buckets of 3 consecutive points.
    for (k, &line) in t.line.iter().enumerate() {
        let line = line as usize;
        let bucket = &points[line..(line + 3).min(points.len())];
        assert_eq!(t.requested[k], bucket.iter().map(|p| p.1).max().unwrap());
        assert_eq!(t.reserved[k], bucket.iter().map(|p| p.2).max().unwrap());
    }
    assert_eq!(
        t.reserved.iter().max(),
        points.iter().map(|p| p.2).max().as_ref()
    );
    let short = downsample(&points[..10]);
    assert_eq!(short.line, (0..10).collect::<Vec<_>>());
}

#[test]
fn bad_command_lines_are_refused_with_the_usage() {
    for (list, words) in [
        (&["x.ops"][..], "--out <DIR>"),
        (&["--out", "d"][..], "<OPS>"),
        (
            &["--out", "d", "--backend", "tpu", "x.ops"][..],
            "cuda, sim",
        ),
        (
            &["--out", "d", "--passes", "0", "x.ops"][..],
            "must be at least 1",
        ),
        (
            &["--out", "d", "--passes", "many", "x.ops"][..],
            "not a whole number",
        ),
        (
            &["--out", "d", "--hot-pairs", "7", "x.ops"][..],
            "at least 8",
        ),
        (
            &["--out", "d", "--only", "jemalloc", "x.ops"][..],
            "unknown allocator",
        ),
        (
            &["--out", "d", "--only", ",", "x.ops"][..],
            "no allocator named",
        ),
        (
            &["--out", "d", "--cachalot-config", "frobnicate:1", "x.ops"][..],
            "--cachalot-config",
        ),
        (&["--out", "d", "--frobnicate", "x.ops"][..], "--frobnicate"),
        (&["--out"][..], "--out <DIR>"),
    ] {
        match options(list) {
            Err(e) => {
                let m = e.render().to_string();
                assert_eq!(e.exit_code(), 2, "{list:?}: {m}");
                // clap's message names the option; it shows the usage or points to --help.
                assert!(m.contains(words), "{m:?}");
                assert!(
                    m.contains("Usage: gpu_compare") || m.contains("try '--help'"),
                    "{m:?}"
                );
            }
            Ok(o) => panic!("{list:?}: {o:?}"),
        }
    }
    let o = options(&["--out", "d", "--no-traces", "--only", "cumemalloc,cachalot"]).unwrap();
    // The run order, whatever the order given.
    assert_eq!(o.only.0, ["cachalot", "cumemalloc"]);
    assert!(!o.traces && o.hot && o.ops.is_empty());
    // The defaults; an option given twice: the last.
    let o = options(&["--out", "d", "--passes", "5", "--passes", "2", "x.ops"]).unwrap();
    assert_eq!(
        (o.passes, o.malloc_prefix, o.hot_pairs),
        (2, 4000, 2_000_000)
    );
    assert_eq!(o.only.0.len(), 5);
    assert!(o.traces && o.hot && o.cachalot_config.is_none());
    // A missing file is an input error naming it, before anything runs.
    let dir = scratch("missing");
    let missing = dir.join("nowhere.ops");
    let o = options(&[
        "--backend",
        "sim",
        "--out",
        dir.to_str().unwrap(),
        missing.to_str().unwrap(),
    ])
    .unwrap();
    match run(&o) {
        Err(Failure::Input(m)) => assert!(m.contains("nowhere.ops"), "{m}"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn the_example_prints_its_usage_on_help_and_refuses_a_bad_command_line_with_code_2() {
    // The example is built with the tests only when asked: run it where cargo put it.
    let exe = Path::new(env!("CARGO_BIN_EXE_cachalot"))
        .parent()
        .unwrap()
        .join("examples")
        .join(format!("gpu_compare{}", std::env::consts::EXE_SUFFIX));
    if !exe.exists() {
        eprintln!("skipped: {} not built", exe.display());
        return;
    }
    let help = Command::new(&exe).arg("--help").output().unwrap();
    assert!(help.status.success());
    let text = String::from_utf8_lossy(&help.stdout);
    for flag in [
        "--out",
        "--backend",
        "--passes",
        "--malloc-prefix",
        "--only",
        "--hot-pairs",
        "--no-hot",
        "--no-traces",
        "--cachalot-config",
    ] {
        assert!(text.contains(flag), "{flag} in {text}");
    }
    let bad = Command::new(&exe)
        .arg("--passes")
        .arg("0")
        .output()
        .unwrap();
    assert_eq!(bad.status.code(), Some(2));
}
