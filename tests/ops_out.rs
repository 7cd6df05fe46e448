//! `cachalot replay --ops-out FILE`: the program written as text (src/ops.rs, "cachalot ops
//! v1") is complete, parses back, has one `a` line per allocation of the trace, and — replayed
//! again from the text alone — gives the figures of the replay that wrote it. The format's one
//! type round-trips every fixture's program (written, parsed, written again: the same text),
//! and malformed files are refused naming the file and the line.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use cachalot_tools::ops::{OpsError, OpsProgram};
use cachalot_tools::replay::{
    ReplayConfig, ReplayOp, ReplayProgram, SnapshotExt, StartMode, replay,
};
use cachalot_tools::snapshot::{Action, read_figures, read_snapshot};

mod common;
use common::{fixtures_root, recorded_config, traces};

fn cachalot(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_cachalot"))
        .args(args)
        .output()
        .expect("the cachalot binary runs")
}

fn scratch(test: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("cachalot-ops-{}-{test}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// An ops file read back: its header, the lines before `s` and after it.
struct Ops {
    header: HashMap<String, String>,
    start: Vec<Vec<String>>,
    trace: Vec<Vec<String>>,
}

fn parse(path: &Path) -> Ops {
    let text = std::fs::read_to_string(path).expect("the ops file was written");
    let mut lines = text.lines();
    assert_eq!(lines.next(), Some("# cachalot ops v1"));
    let mut ops = Ops {
        header: HashMap::new(),
        start: Vec::new(),
        trace: Vec::new(),
    };
    let mut seen_s = false;
    for line in lines {
        if let Some(kv) = line.strip_prefix("# ") {
            let (k, v) = kv.split_once(": ").expect("a `# key: value` header line");
            ops.header.insert(k.to_string(), v.to_string());
            continue;
        }
        let fields: Vec<String> = line.split(' ').map(str::to_string).collect();
        let arity = match fields[0].as_str() {
            "a" => 4,
            "r" => 3,
            "f" | "c" => 2,
            "e" | "s" => 1,
            other => panic!("unknown operation {other:?} in {line:?}"),
        };
        assert_eq!(fields.len(), arity, "{line:?}");
        for f in &fields[1..] {
            f.parse::<u64>()
                .unwrap_or_else(|_| panic!("not a number in {line:?}"));
        }
        if fields[0] == "s" {
            assert!(!seen_s, "one `s` line");
            seen_s = true;
        } else if seen_s {
            ops.trace.push(fields);
        } else {
            ops.start.push(fields);
        }
    }
    assert!(seen_s, "an `s` line");
    ops
}

fn num(ops: &Ops, key: &str) -> usize {
    ops.header[key].parse().unwrap()
}

/// Checks the lines' consistency: handles below `handles`, allocated once, freed after their
/// allocation at most once; every `r` directly followed by the `f` of its handle; every `c`
/// names a side stream an `r` used.
fn check_consistent(ops: &Ops) {
    let handles = num(ops, "handles");
    let mut allocated = HashSet::new();
    let mut freed = HashSet::new();
    let mut sides = HashSet::new();
    let all: Vec<&Vec<String>> = ops.start.iter().chain(&ops.trace).collect();
    for (i, l) in all.iter().enumerate() {
        let n = |k: usize| l[k].parse::<usize>().unwrap();
        match l[0].as_str() {
            "a" => {
                assert!(n(1) < handles);
                assert!(allocated.insert(n(1)), "handle {} allocated twice", n(1));
            }
            "f" => {
                assert!(allocated.contains(&n(1)) || n(1) < num(ops, "handles"));
                assert!(freed.insert(n(1)), "handle {} freed twice", n(1));
            }
            "r" => {
                assert_eq!(all[i + 1][0], "f", "an r line is followed by its free");
                assert_eq!(all[i + 1][1], l[1]);
                sides.insert(n(2));
            }
            "c" => assert!(sides.contains(&n(1)), "c {} before any r of it", n(1)),
            _ => {}
        }
    }
    let allocs = ops.trace.iter().filter(|l| l[0] == "a").count();
    assert_eq!(allocs, num(ops, "allocs"));
    let start_allocs = ops.start.iter().filter(|l| l[0] == "a").count();
    assert_eq!(start_allocs, num(ops, "start_allocs"));
}

/// The program of an ops file with an empty start, as cachalot's replay program.
fn program_of(ops: &Ops) -> ReplayProgram {
    assert!(ops.start.is_empty());
    let mut program = ReplayProgram::default();
    let mut i = 0;
    while i < ops.trace.len() {
        let l = &ops.trace[i];
        let n = |k: usize| l[k].parse::<u64>().unwrap();
        match l[0].as_str() {
            "a" => program.ops.push(ReplayOp::Alloc {
                id: n(1) as usize,
                size: n(2),
                stream: n(3),
            }),
            "r" => {
                // Held back: the free, then (later) the `c` completes it.
                program
                    .ops
                    .push(ReplayOp::FreeRequested { id: n(1) as usize });
                i += 1; // its `f`
            }
            "f" => {
                program
                    .ops
                    .push(ReplayOp::FreeRequested { id: n(1) as usize });
                program
                    .ops
                    .push(ReplayOp::FreeCompleted { id: n(1) as usize });
            }
            "c" => program
                .ops
                .push(ReplayOp::FreeCompleted { id: n(1) as usize }),
            "e" => program.ops.push(ReplayOp::EmptyCache),
            _ => unreachable!(),
        }
        i += 1;
    }
    program
}

fn export(trace: &Path, extra: &[&str], out: &Path) -> serde_json::Value {
    let mut args = vec![
        "replay",
        trace.to_str().unwrap(),
        "--pytorch",
        "--json",
        "--ops-out",
        out.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    let o = cachalot(&args);
    assert!(
        o.status.success(),
        "cachalot failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    serde_json::from_slice(&o.stdout).expect("one JSON object")
}

/// The trace's allocations: its `alloc` entries and the `oom` ones (replayed as allocations
/// that fail again).
fn trace_allocs(path: &Path) -> usize {
    let snapshot = read_snapshot(path).unwrap();
    snapshot.traces[0]
        .entries
        .iter()
        .filter(|e| matches!(e.action, Action::Alloc | Action::Oom))
        .count()
}

#[test]
fn every_trace_exports_a_program_that_parses_back_with_one_alloc_line_per_allocation() {
    let dir = scratch("all");
    let mut paths: Vec<PathBuf> = std::fs::read_dir(traces())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "pickle"))
        .collect();
    paths.sort();
    assert!(paths.len() >= 10);
    for path in &paths {
        let name = path.file_stem().unwrap().to_string_lossy().to_string();
        let out = dir.join(format!("{name}.ops"));
        let report = export(path, &[], &out);
        let ops = parse(&out);
        check_consistent(&ops);
        assert_eq!(ops.header["start"], "fresh", "{name}");
        assert_eq!(num(&ops, "allocs"), trace_allocs(path), "{name}");
        assert_eq!(
            num(&ops, "program_ops"),
            report["ops"].as_u64().unwrap() as usize
        );
        if name == "two_stream" {
            // The trace's held-back frees: 12 uses on the side stream, 11 completed.
            assert_eq!(ops.trace.iter().filter(|l| l[0] == "r").count(), 12);
            assert_eq!(ops.trace.iter().filter(|l| l[0] == "c").count(), 11);
        }
        if name == "empty_cache_loop" {
            assert_eq!(ops.trace.iter().filter(|l| l[0] == "e").count(), 8);
        }
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn the_text_alone_replays_to_the_figures_of_the_replay_that_wrote_it() {
    let dir = scratch("roundtrip");
    for name in [
        "two_stream",
        "gpt2_train",
        "fraction_oom_retry",
        "empty_cache_loop",
    ] {
        let path = traces().join(format!("{name}.pickle"));
        let out = dir.join(format!("{name}.ops"));
        let report = export(&path, &[], &out);
        let program = program_of(&parse(&out));
        let figures = read_figures(&traces().join(format!("{name}.json"))).unwrap();
        let config = ReplayConfig {
            trace_addresses: false,
            ..recorded_config(&figures)
        };
        let outcome = replay(&program, &config).unwrap();
        assert_eq!(
            outcome.peak_reserved_bytes,
            report["peak_reserved_bytes"].as_u64().unwrap(),
            "{name}"
        );
        assert_eq!(
            outcome.peak_allocated_bytes,
            report["peak_allocated_bytes"].as_u64().unwrap(),
            "{name}"
        );
        assert_eq!(outcome.ooms, report["ooms"].as_u64().unwrap(), "{name}");
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_mid_run_recording_exports_from_its_live_tensors_and_refuses_pytorchs_layout() {
    let dir = scratch("midrun");
    let path = fixtures_root().join("user/resnet50_warm.pickle.gz");
    let out = dir.join("resnet50_warm.ops");
    // The exact start (PyTorch's cached layout, adopted) is no sequence of operations.
    let o = cachalot(&[
        "replay",
        path.to_str().unwrap(),
        "--pytorch",
        "--ops-out",
        out.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(2));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("--start live-tensors"), "{err}");
    assert!(!out.exists());

    let report = export(&path, &["--start", "live-tensors"], &out);
    assert_eq!(report["start"]["replayed_from"], "live_tensors");
    let ops = parse(&out);
    check_consistent(&ops);
    assert!(ops.header["start"].starts_with("live_tensors (645 tensors"));
    assert_eq!(num(&ops, "start_allocs"), 645);
    assert_eq!(
        num(&ops, "start_allocs"),
        report["start"]["live_tensors"].as_u64().unwrap() as usize
    );
    assert_eq!(num(&ops, "allocs"), trace_allocs(&path));
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn every_fixture_program_renders_parses_and_renders_again_to_the_same_text() {
    let mut files: Vec<PathBuf> = Vec::new();
    for dir in ["traces", "user", "expandable"] {
        for e in std::fs::read_dir(fixtures_root().join(dir)).unwrap() {
            let p = e.unwrap().path();
            let name = p.to_string_lossy().to_string();
            if name.ends_with(".pickle") || name.ends_with(".pickle.gz") {
                files.push(p);
            }
        }
    }
    files.sort();
    assert!(files.len() >= 25, "{}", files.len());
    let mut with_start = 0;
    for path in &files {
        let snapshot = read_snapshot(path).unwrap();
        for (device, program) in snapshot.replay_programs() {
            for mode in [StartMode::LiveTensors, StartMode::Empty] {
                let at = format!("{} device {device} {mode:?}", path.display());
                let mut ops = OpsProgram::from_replay(&program, mode);
                ops.header = vec![
                    ("trace".into(), path.display().to_string()),
                    ("settings".into(), "expandable_segments:True".into()),
                ];
                let text = ops.render();
                let back =
                    OpsProgram::parse("x.ops", &text).unwrap_or_else(|e| panic!("{at}: {e}"));
                assert_eq!(back, ops, "{at}");
                assert_eq!(back.render(), text, "{at}");
                assert_eq!(
                    back.header_value("settings"),
                    Some("expandable_segments:True")
                );
                let (start_allocs, allocs) = back.allocs();
                let trace_allocs = program
                    .ops
                    .iter()
                    .filter(|op| matches!(op, ReplayOp::Alloc { .. }))
                    .count();
                assert_eq!(allocs, trace_allocs, "{at}");
                let expected = if mode == StartMode::LiveTensors {
                    program.initial.len()
                } else {
                    0
                };
                assert_eq!(start_allocs, expected, "{at}");
                with_start += usize::from(start_allocs > 0);
            }
        }
    }
    assert!(with_start >= 2, "{with_start} programs with a start");
}

fn input_error(text: &str) -> OpsError {
    match OpsProgram::parse("bad.ops", text) {
        Err(e) => e,
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
        let e = input_error(&format!("{head}{body}"));
        let m = e.to_string();
        let at = if line == 0 {
            "bad.ops: ".to_string()
        } else {
            format!("bad.ops:{line}: ")
        };
        assert!(m.starts_with(&at), "{m:?} for {body:?}");
        assert!(m.contains(words), "{m:?} for {body:?}");
        assert_eq!(e.line, (line > 0).then_some(line), "{body:?}");
    }
    let m = input_error("a 0 10 0\ns\n").to_string();
    assert!(
        m.starts_with("bad.ops:1: ") && m.contains("cachalot ops v1"),
        "{m}"
    );
    // Well formed: frees of handles never allocated (an empty start) are allowed.
    let p = OpsProgram::parse(
        "ok.ops",
        &format!("{head}a 5 1 3\ns\nf 9\nr 5 5\nf 5\nc 5\ne\n"),
    )
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!((p.start.len(), p.trace.len()), (1, 5));
    assert_eq!(
        (p.handles, p.streams, p.sides),
        (vec![5, 9], vec![3], vec![5])
    );
    // A missing file is named.
    let e = OpsProgram::read(Path::new("/nonexistent/nowhere.ops")).unwrap_err();
    assert!(
        e.to_string()
            .starts_with("/nonexistent/nowhere.ops: cannot read"),
        "{e}"
    );
}
