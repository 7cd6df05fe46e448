//! `cachalot bench-report`: the side-by-side GPU benchmark's run files (docs/GPU_BENCH.md)
//! become results.json, results.csv, results.md with the targets, and SVG plots; a file that
//! is not a run is refused with its name.

use std::path::Path;
use std::process::{Command, Output};

use serde_json::json;

fn cachalot(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_cachalot"))
        .args(args)
        .output()
        .expect("cachalot runs")
}

fn trace_run(
    allocator: &str,
    trace: &str,
    requested: u64,
    reserved: u64,
    steady: f64,
) -> serde_json::Value {
    let n = 50u64;
    json!({
        "schema": "cachalot gpu-bench v1",
        "kind": "trace",
        "allocator": allocator,
        "trace": trace,
        "lines": 1000, "total_lines": 1000, "allocs": 500, "ooms": 0,
        "peak_requested": requested,
        "peak_reserved": reserved,
        "peak_allocated": null,
        "ratio": reserved as f64 / requested as f64,
        "driver_calls": 7, "driver_calls_detail": "test",
        "reserved_changes": 7, "cache_hits": 493, "hit_rate": 0.986,
        "passes": 3,
        "ns_per_op_first": steady * 3.0,
        "ns_per_op_steady": steady,
        "timeline": {
            "line": (0..n).map(|i| i * 20).collect::<Vec<_>>(),
            "requested": (0..n).map(|i| requested * i / n).collect::<Vec<_>>(),
            "reserved": (0..n).map(|i| reserved * i / n).collect::<Vec<_>>(),
        },
        "notes": null
    })
}

fn hot(allocator: &str, path: &str, walls: [f64; 4]) -> serde_json::Value {
    json!({
        "schema": "cachalot gpu-bench v1",
        "kind": "hot_loop",
        "allocator": allocator,
        "path": path,
        "size": 1048576,
        "threads": [1, 2, 4, 8],
        "pairs_per_thread": [1000, 500, 250, 125],
        "wall_ns_per_pair": walls,
        "ns_per_pair_per_thread": [walls[0], walls[1] * 2.0, walls[2] * 4.0, walls[3] * 8.0],
    })
}

/// The targets table's line that starts with `start`.
fn target_line(md: &str, start: &str) -> String {
    md.lines()
        .find(|l| l.starts_with(&format!("| {start}")))
        .unwrap_or_else(|| panic!("no target line starting {start:?} in\n{md}"))
        .to_string()
}

/// Runs `cachalot bench-report DIR`, which must succeed, and returns its results.md.
fn report_md(dir: &Path) -> String {
    let out = cachalot(&["bench-report", dir.to_str().unwrap()]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    std::fs::read_to_string(dir.join("results.md")).unwrap()
}

fn write_runs(dir: &Path, runs: &[serde_json::Value]) {
    let runs_dir = dir.join("runs");
    std::fs::create_dir_all(&runs_dir).unwrap();
    for (i, r) in runs.iter().enumerate() {
        std::fs::write(runs_dir.join(format!("{i:03}.json")), r.to_string()).unwrap();
    }
    std::fs::write(
        dir.join("machine.json"),
        json!({"gpu": "test GPU", "date": "2026-12-01"}).to_string(),
    )
    .unwrap();
}

fn tmp(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!(
        "cachalot-bench-report-{}-{name}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&d);
    d
}

#[test]
fn the_report_states_each_target_met_or_missed_with_its_figures() {
    let dir = tmp("targets");
    let mib = 1u64 << 20;
    write_runs(
        &dir,
        &[
            // bert: same memory under PyTorch's policy, cachalot's policy below everyone.
            trace_run("pytorch", "bert", 100 * mib, 150 * mib, 400.0),
            trace_run("pytorch-expandable", "bert", 100 * mib, 120 * mib, 420.0),
            trace_run("cuda-pool", "bert", 100 * mib, 110 * mib, 900.0),
            trace_run("cachalot-pytorch", "bert", 100 * mib, 150 * mib, 40.0),
            trace_run("cachalot", "bert", 100 * mib, 102 * mib, 45.0),
            // gpt: cachalot's PyTorch policy holds 2 MiB more; its own policy ties the pool;
            // replay only 4× faster.
            trace_run("pytorch", "gpt", 200 * mib, 240 * mib, 300.0),
            trace_run("cuda-pool", "gpt", 200 * mib, 204 * mib, 800.0),
            trace_run("cachalot-pytorch", "gpt", 200 * mib, 242 * mib, 75.0),
            trace_run("cachalot", "gpt", 200 * mib, 204 * mib, 75.0),
            hot("pytorch", "raw", [400.0, 800.0, 1600.0, 3200.0]),
            hot("cachalot", "allocator", [80.0, 40.0, 20.0, 10.0]),
            hot("cachalot", "buffer", [100.0, 60.0, 40.0, 200.0]),
        ],
    );
    let md = report_md(&dir);
    let target = |start: &str| target_line(&md, start);
    // 1 thread: 400/80 = 5× and 400/100 = 4×: missed.
    let one = target("hot 1 MiB pair on 1 thread");
    assert!(one.contains("| **no** |"), "{one}");
    assert!(one.contains("through allocator: 5.0×"), "{one}");
    // 8 threads: 3200/10 = 320× met through the allocator, 16× through buffers: missed.
    let eight = target("hot 1 MiB pairs, 8 threads");
    assert!(
        eight.contains("| **no** |") && eight.contains("through allocator: 320.0×"),
        "{eight}"
    );
    assert!(eight.contains("through buffer: 16.0×"), "{eight}");
    // Replay speed: bert 400/45 = 8.9×, gpt 300/75 = 4× → 1 of 2.
    let speed = target("trace replay, steady ns/op: cachalot's policy");
    assert!(
        speed.contains("1 of 2 traces reach 8×") && speed.contains("worst gpt 4.00×"),
        "{speed}"
    );
    let same = target("with PyTorch's settings");
    assert!(
        same.contains("| **no** |") && same.contains("equal on 1 of 2") && same.contains("gpt:"),
        "{same}"
    );
    let own = target("cachalot's policy holds less");
    assert!(
        own.contains("| **no** |")
            && own.contains("below on 1 of 2")
            && own.contains("gpt (= CUDA pool)"),
        "{own}"
    );
    // The memory table marks the least memory per trace, and the machine is named.
    assert!(md.contains("**1.020 (102.0 MiB)**"), "{md}");
    assert!(md.contains("- gpu: test GPU"), "{md}");
    // CSV: a header and one line per run; JSON: no timelines, the targets.
    let csv = std::fs::read_to_string(dir.join("results.csv")).unwrap();
    assert_eq!(csv.lines().count(), 1 + 9);
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("results.json")).unwrap()).unwrap();
    assert_eq!(json["traces"].as_array().unwrap().len(), 9);
    assert!(json["traces"][0].get("timeline").is_none());
    assert_eq!(json["targets"].as_array().unwrap().len(), 9);
    for svg in [
        "fragmentation.svg",
        "ns_per_op.svg",
        "hot_loop.svg",
        "timeline_bert.svg",
        "timeline_gpt.svg",
    ] {
        let text = std::fs::read_to_string(dir.join(svg)).unwrap_or_else(|e| panic!("{svg}: {e}"));
        assert!(text.starts_with("<svg") && text.len() > 1000, "{svg}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn targets_met_say_yes() {
    let dir = tmp("met");
    let mib = 1u64 << 20;
    write_runs(
        &dir,
        &[
            trace_run("pytorch", "bert", 100 * mib, 150 * mib, 400.0),
            trace_run("cachalot-pytorch", "bert", 100 * mib, 150 * mib, 40.0),
            trace_run("cachalot", "bert", 100 * mib, 102 * mib, 45.0),
        ],
    );
    let md = report_md(&dir);
    for start in [
        "trace replay, steady ns/op: cachalot's policy",
        "with PyTorch's settings",
        "cachalot's policy holds less",
    ] {
        let line = md
            .lines()
            .find(|l| l.starts_with(&format!("| {start}")))
            .unwrap();
        assert!(line.contains("| yes |"), "{line}");
    }
    // Not measured: no hot loops.
    let line = md
        .lines()
        .find(|l| l.starts_with("| hot 1 MiB pair"))
        .unwrap();
    assert!(
        line.contains("| – |") && line.contains("not measured"),
        "{line}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A trace run with driver calls and ns/op per steady pass (passes 2, 3, …).
fn with_passes(mut run: serde_json::Value, calls: &[u64], ns: &[f64]) -> serde_json::Value {
    let n = calls.len() as f64;
    run["driver_calls_steady"] = json!(calls.iter().sum::<u64>() as f64 / n);
    run["ns_per_op_steady"] = json!(ns.iter().sum::<f64>() / n);
    run["steady_passes_driver_calls"] = json!(calls);
    run["steady_passes_ns_per_op"] = json!(ns);
    run
}

#[test]
fn the_default_policys_targets_compare_it_with_pytorchs_policy_in_the_same_run() {
    let dir = tmp("default-policy");
    let mib = 1u64 << 20;
    write_runs(
        &dir,
        &[
            // bert: views made in pass 2 only (12 calls, slow), none after: the steady mean
            // misses both targets, passes 3 on meet them; memory 1.02×.
            with_passes(
                trace_run("cachalot-pytorch", "bert", 100 * mib, 150 * mib, 0.0),
                &[0, 0, 0],
                &[100.0, 100.0, 100.0],
            ),
            with_passes(
                trace_run("cachalot", "bert", 100 * mib, 102 * mib, 0.0),
                &[12, 0, 0],
                &[700.0, 110.0, 115.0],
            ),
            // gpt: no call on either side; 1.5× slower every pass; memory 1.05×.
            with_passes(
                trace_run("cachalot-pytorch", "gpt", 200 * mib, 240 * mib, 0.0),
                &[0, 0, 0],
                &[100.0, 100.0, 100.0],
            ),
            with_passes(
                trace_run("cachalot", "gpt", 200 * mib, 210 * mib, 0.0),
                &[0, 0, 0],
                &[150.0, 150.0, 150.0],
            ),
        ],
    );
    let md = report_md(&dir);
    let target = |start: &str| target_line(&md, start);
    let calls = target("driver calls per steady pass");
    assert!(
        calls.contains("| **no** |")
            && calls.contains("met on 1 of 2 (from pass 3 on: 2 of 2)")
            && calls.contains("bert 4.0 vs 0.0"),
        "{calls}"
    );
    // bert: 308.3 vs 100 ns/op (3.08×), passes 3 on 112.5 (1.125×); gpt 1.5× throughout.
    let speed = target("steady ns/op: cachalot's policy within 1.2×");
    assert!(
        speed.contains("| **no** |")
            && speed.contains("met on 0 of 2 (passes 3 on: 1 of 2)")
            && speed.contains("slower: bert 3.08×, gpt 1.50×"),
        "{speed}"
    );
    // No ops files here: the ratio is over peak requested.
    let memory = target("memory: cachalot's policy ≤ 1.03×");
    assert!(
        memory.contains("| **no** |")
            && memory.contains("met on 1 of 2")
            && memory.contains("above: gpt 1.050"),
        "{memory}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Writes one repetition's run files under `dir/repeats/name/runs/`.
fn write_repeat(dir: &Path, name: &str, runs: &[serde_json::Value]) {
    let runs_dir = dir.join("repeats").join(name).join("runs");
    std::fs::create_dir_all(&runs_dir).unwrap();
    for (i, r) in runs.iter().enumerate() {
        std::fs::write(runs_dir.join(format!("{i:03}.json")), r.to_string()).unwrap();
    }
}

/// c-pt at 100 ns/op and cachalot's policy at `ns` on `trace`, every steady pass.
fn speed_pair(trace: &str, ns: f64) -> [serde_json::Value; 2] {
    let mib = 1u64 << 20;
    [
        with_passes(
            trace_run("cachalot-pytorch", trace, 100 * mib, 150 * mib, 0.0),
            &[0, 0, 0],
            &[100.0, 100.0, 100.0],
        ),
        with_passes(
            trace_run("cachalot", trace, 100 * mib, 101 * mib, 0.0),
            &[0, 0, 0],
            &[ns, ns, ns],
        ),
    ]
}

#[test]
fn the_speed_target_takes_the_median_of_the_paired_ratios_of_every_repetition() {
    // gpt: 1.5× in the main run, 1.1× and 1.15× in the repetitions: the median (1.15×) meets
    // 1.2×. bert: 1.1× in the main run, 1.4× and 1.5× after: the median (1.4×) misses. Without
    // the repetitions the main run alone decides the other way on both.
    let dir = tmp("repeats");
    let main: Vec<_> = [speed_pair("gpt", 150.0), speed_pair("bert", 110.0)].concat();
    write_runs(&dir, &main);
    let report = |dir: &Path| {
        target_line(
            &report_md(dir),
            "steady ns/op: cachalot's policy within 1.2×",
        )
    };
    let alone = report(&dir);
    assert!(
        alone.contains("met on 1 of 2") && alone.contains("slower: gpt 1.50×"),
        "{alone}"
    );
    assert!(!alone.contains("paired runs"), "{alone}");
    write_repeat(
        &dir,
        "2",
        &[speed_pair("gpt", 110.0), speed_pair("bert", 140.0)].concat(),
    );
    write_repeat(
        &dir,
        "3",
        &[speed_pair("gpt", 115.0), speed_pair("bert", 150.0)].concat(),
    );
    let repeated = report(&dir);
    assert!(
        repeated.contains("median of up to 3 paired runs; met on 1 of 2 (passes 3 on: 1 of 2)")
            && repeated.contains("slower: bert 1.40×")
            && !repeated.contains("gpt 1."),
        "{repeated}"
    );
    // A repetition's file that is not a run is refused by name, as the main run's are.
    std::fs::write(dir.join("repeats/3/runs/bad.json"), "{}").unwrap();
    let out = cachalot(&["bench-report", dir.to_str().unwrap()]);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("bad.json"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_file_that_is_not_a_run_is_refused_by_name() {
    for (bad, why) in [
        ("{\"schema\": \"something else\"}", "schema"),
        ("not json", "not a `cachalot gpu-bench v1` run"),
        (
            "{\"schema\": \"cachalot gpu-bench v1\", \"kind\": \"trace\", \"allocator\": \"x\"}",
            "without a `trace`",
        ),
        (
            "{\"schema\": \"cachalot gpu-bench v1\", \"kind\": \"hot_loop\", \"allocator\": \"x\", \"threads\": [1, 2], \"pairs_per_thread\": [1], \"wall_ns_per_pair\": [1.0]}",
            "differ in length",
        ),
        (
            "{\"schema\": \"cachalot gpu-bench v1\", \"kind\": \"trace\", \"allocator\": \"x\", \"trace\": \"t\", \"peak_reserved\": -5}",
            "invalid value",
        ),
    ] {
        let dir = tmp("bad");
        std::fs::create_dir_all(dir.join("runs")).unwrap();
        std::fs::write(dir.join("runs/broken.json"), bad).unwrap();
        let out = cachalot(&["bench-report", dir.to_str().unwrap()]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{bad}: {err}");
        assert!(
            err.contains("broken.json") && err.contains(why),
            "{bad}: {err}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
    let empty = tmp("empty");
    std::fs::create_dir_all(empty.join("runs")).unwrap();
    let out = cachalot(&["bench-report", empty.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("no run files"));
    let _ = std::fs::remove_dir_all(&empty);
}

#[test]
fn older_and_failed_runs_are_read_with_their_missing_figures_shown_as_missing() {
    let dir = tmp("older");
    let mib = 1u64 << 20;
    let mut older = trace_run("cachalot", "bert", 100 * mib, 102 * mib, 45.0);
    // A file from before `reserved_changes`, `cache_hits` and the first pass's timing.
    for key in [
        "reserved_changes",
        "cache_hits",
        "ns_per_op_first",
        "timeline",
    ] {
        older.as_object_mut().unwrap().remove(key);
    }
    write_runs(
        &dir,
        &[
            older,
            trace_run("pytorch", "bert", 100 * mib, 150 * mib, 400.0),
            // A failed run of scripts/pytorch_bench.py: its error only.
            json!({"schema": "cachalot gpu-bench v1", "kind": "trace",
                   "allocator": "pytorch-expandable", "trace": "bert", "error": "it broke"}),
            json!({"schema": "cachalot gpu-bench v1", "kind": "hot_loop",
                   "allocator": "pytorch", "path": "raw", "error": "it broke too"}),
        ],
    );
    let md = report_md(&dir);
    // Driver table: calls / reserved-memory changes / hit rate; the older run's changes: –.
    assert!(md.contains("| 7 / – / 98.6% |"), "{md}");
    // Speed: steady (first); the older run's first pass: –.
    assert!(md.contains("| 45 (–) |"), "{md}");
    assert!(
        md.contains("PyTorch expandable: failed: it broke (bert)"),
        "{md}"
    );
    assert!(
        md.contains("PyTorch hot loop (raw): failed: it broke too"),
        "{md}"
    );
    let csv = std::fs::read_to_string(dir.join("results.csv")).unwrap();
    assert!(csv.contains(",it broke\n"), "{csv}");
    // results.json lists every run's `error`, null when it ran.
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("results.json")).unwrap()).unwrap();
    let errors: Vec<&serde_json::Value> = json["traces"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| &t["error"])
        .collect();
    // In table order: PyTorch, PyTorch expandable, cachalot.
    assert_eq!(errors, [&json!(null), &json!("it broke"), &json!(null)]);
    assert_eq!(json["hot_loops"][0]["error"], "it broke too");
    let _ = std::fs::remove_dir_all(&dir);
}
