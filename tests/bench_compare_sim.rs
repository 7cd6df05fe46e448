//! `benches/gpu_compare.rs` without a GPU (`--backend sim`, what CI runs): on a committed
//! program (`tests/fixtures/ops/two_stream.ops`, written by `cachalot replay --pytorch --ops-out`, with
//! held-back frees) it writes one valid `cachalot gpu-bench v1` object per allocator and hot
//! loop, whose figures agree with the program itself; bad command lines and malformed ops files
//! are refused with a clear message naming the file and line, never a panic.

#[path = "../benches/gpu_compare.rs"]
#[allow(dead_code)]
mod gpu_compare;

use std::path::{Path, PathBuf};

use gpu_compare::{Failure, HotRun, TraceRun, downsample, parse_options, parse_program, run};

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

fn args(list: &[&str]) -> Vec<String> {
    list.iter().map(|s| s.to_string()).collect()
}

fn read<T: serde::de::DeserializeOwned>(path: &Path) -> T {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let value: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(
        value["schema"],
        "cachalot gpu-bench v1",
        "{}",
        path.display()
    );
    serde_json::from_value(value).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// What the program itself says, counted here without the example's interpreter: the lines
/// after `s`, its `a` lines, and the peak of live requested bytes (a free held back by an `r`
/// line no longer counts, as the benchmark counts it).
fn program_figures(text: &str) -> (usize, usize, u64) {
    let mut after_s = false;
    let (mut lines, mut allocs) = (0, 0);
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
                allocs += usize::from(after_s);
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
    let a = args(&[
        "--backend",
        "sim",
        "--out",
        out.to_str().unwrap(),
        "--passes",
        "2",
        "--hot-pairs",
        "4000",
        ops.to_str().unwrap(),
    ]);
    run(&a).unwrap_or_else(|e| panic!("gpu_compare failed: {e}"));

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
        );
        assert_eq!(
            (r.kind.as_str(), r.allocator.as_str()),
            ("trace", allocator)
        );
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
        assert!(r.cache_hits <= r.allocs && r.reserved_changes > 0);
        assert!((r.hit_rate.unwrap() - r.cache_hits as f64 / r.allocs as f64).abs() < 1e-12);
        assert_eq!(r.passes, 2);
        assert!(r.ns_per_op_first > 0.0 && r.ns_per_op_steady.unwrap() > 0.0);
        // Fewer lines than points allowed: one point after `s` and one after each line.
        let t = &r.timeline;
        assert_eq!(t.line, (0..=lines).collect::<Vec<_>>());
        assert_eq!(t.requested.len(), lines + 1);
        assert_eq!(t.requested.iter().max(), Some(&r.peak_requested));
        assert_eq!(t.reserved.iter().max(), Some(&r.peak_reserved));
        assert!(r.notes.contains("simulated"));

        let h: HotRun = read(
            &out.join("runs")
                .join(format!("{allocator}__hot__allocator.json")),
        );
        assert_eq!(
            (h.kind.as_str(), h.path.as_str()),
            ("hot_loop", "allocator")
        );
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

#[test]
fn the_timeline_keeps_at_most_1000_points_each_its_buckets_maximum() {
    let points: Vec<(usize, u64, u64)> = (0..2500)
        .map(|i| (i, (i as u64 * 7919) % 1000, (i as u64 * 104_729) % 5000))
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

fn input_error(text: &str) -> String {
    match parse_program("bad", "bad.ops", text) {
        Err(Failure::Input(m)) => m,
        Err(other) => panic!("not an input error: {other}"),
        Ok(_) => panic!("accepted: {text:?}"),
    }
}

#[test]
fn malformed_ops_files_are_refused_naming_the_file_and_line() {
    let head = "# cachalot ops v1\n# handles: 2\n";
    for (body, line, words) in [
        ("s\na 0 10\n", 4, "takes 3"),
        ("s\na 0 ten 0\n", 4, "not a decimal number"),
        ("s\nx 1\n", 4, "unknown operation"),
        ("s\na 0 10 0\na 0 10 0\n", 5, "allocated again while live"),
        ("s\na 0 10 0\nr 0 0\nc 0\n", 5, "followed directly by `f 0`"),
        ("s\na 0 10 0\nr 0 0\n", 5, "followed directly by `f 0`"),
        ("s\ns\n", 4, "a second `s`"),
        ("a 0 10 0\n", 0, "no `s` line"),
        ("s\nf -1\n", 4, "not a decimal number"),
    ] {
        let m = input_error(&format!("{head}{body}"));
        let at = if line == 0 {
            "bad.ops: ".to_string()
        } else {
            format!("bad.ops:{line}: ")
        };
        assert!(m.starts_with(&at), "{m:?} for {body:?}");
        assert!(m.contains(words), "{m:?} for {body:?}");
    }
    let m = input_error("a 0 10 0\ns\n");
    assert!(
        m.starts_with("bad.ops:1: ") && m.contains("cachalot ops v1"),
        "{m}"
    );
    // Well formed: frees of handles never allocated (an empty start) are allowed.
    let p = parse_program(
        "ok",
        "ok.ops",
        &format!("{head}a 5 1 3\ns\nf 9\nr 5 5\nf 5\nc 5\ne\n"),
    )
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!((p.start.len(), p.trace.len()), (1, 5));
    assert_eq!(
        (p.handles, p.streams, p.sides),
        (vec![5, 9], vec![3], vec![5])
    );
}

#[test]
fn bad_command_lines_are_refused_with_the_usage() {
    for (list, words) in [
        (&["x.ops"][..], "--out DIR is required"),
        (&["--out", "d"][..], "no ops files"),
        (
            &["--out", "d", "--backend", "tpu", "x.ops"][..],
            "must be cuda or sim",
        ),
        (&["--out", "d", "--passes", "0", "x.ops"][..], "at least 1"),
        (
            &["--out", "d", "--passes", "many", "x.ops"][..],
            "not a whole number",
        ),
        (
            &["--out", "d", "--only", "jemalloc", "x.ops"][..],
            "unknown allocator",
        ),
        (
            &["--out", "d", "--frobnicate", "x.ops"][..],
            "unknown option",
        ),
        (&["--out"][..], "needs a directory"),
    ] {
        match parse_options(&args(list)) {
            Err(e @ Failure::Usage(_)) => {
                let m = e.to_string();
                assert!(
                    m.contains(words) && m.contains("usage: gpu_compare"),
                    "{m:?}"
                );
            }
            other => panic!("{list:?}: {other:?}"),
        }
    }
    let o = parse_options(&args(&[
        "--out",
        "d",
        "--no-traces",
        "--only",
        "cumemalloc,cachalot",
    ]))
    .unwrap();
    // The run order, whatever the order given.
    assert_eq!(o.only, ["cachalot", "cumemalloc"]);
    assert!(!o.traces && o.hot && o.ops.is_empty());
    // A missing file is an input error naming it, before anything runs.
    let dir = scratch("missing");
    let missing = dir.join("nowhere.ops");
    let a = args(&[
        "--backend",
        "sim",
        "--out",
        dir.to_str().unwrap(),
        missing.to_str().unwrap(),
    ]);
    match run(&a) {
        Err(Failure::Input(m)) => assert!(m.contains("nowhere.ops"), "{m}"),
        other => panic!("{other:?}"),
    }
}
