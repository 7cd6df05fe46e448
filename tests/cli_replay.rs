//! The `cachalot` binary, run as a user runs it: `replay` on the committed PyTorch traces
//! (JSON and human reports, PyTorch's figures beside cachalot's, plots, snapshots) and its
//! answers to bad input (exit code 2, a message naming the file or the key, never a panic).

use std::path::PathBuf;
use std::process::{Command, Output};

use cachalot::Settings;
use cachalot_tools::export::segment_states;
use cachalot_tools::replay::{ReplayConfig, ReplayOptions, replay, replay_ops_with};
use cachalot_tools::snapshot::read_snapshot;

mod common;
use common::traces as fixtures;

fn fixture(name: &str) -> PathBuf {
    fixtures().join(format!("{name}.pickle"))
}

fn all_fixtures() -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(fixtures())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "pickle"))
        .collect();
    v.sort();
    v
}

/// A scratch folder of this test process.
fn scratch(test: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("cachalot-cli-{}-{test}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn cachalot(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_cachalot"))
        .args(args)
        .output()
        .expect("the cachalot binary runs")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn json(o: &Output) -> serde_json::Value {
    assert!(o.status.success(), "cachalot failed: {}", stderr(o));
    serde_json::from_slice(&o.stdout).expect("one JSON object on stdout")
}

const KEYS: [&str; 19] = [
    "trace",
    "config",
    "backend",
    "ops",
    "allocs",
    "frees",
    "peak_requested_bytes",
    "peak_allocated_bytes",
    "peak_reserved_bytes",
    "fragmentation",
    "device_allocs",
    "device_frees",
    "cache_hit_rate",
    "ooms",
    "ns_per_op",
    "peak_segments",
    "empty_cache_at_peak_bytes",
    "stranded_at_peak_bytes",
    "device_total_bytes",
];

#[test]
fn json_reports_every_key_and_pytorchs_figures_equal_cachalots_on_every_fixture() {
    let fixtures = all_fixtures();
    assert!(fixtures.len() >= 8);
    for trace in fixtures {
        let out = cachalot(&["replay", trace.to_str().unwrap(), "--pytorch", "--json"]);
        let j = json(&out);
        for key in KEYS {
            assert!(j.get(key).is_some(), "{}: no {key} in {j}", trace.display());
        }
        assert_eq!(j["backend"], "sim");
        assert_eq!(j["pytorch_matches"], true, "{}: {j}", trace.display());
        for (ours, theirs) in [
            ("peak_reserved_bytes", "pytorch_peak_reserved_bytes"),
            ("peak_allocated_bytes", "pytorch_peak_allocated_bytes"),
            ("peak_segments", "pytorch_peak_segments"),
            ("device_allocs", "pytorch_device_allocs"),
            ("device_frees", "pytorch_device_frees"),
            ("ooms", "pytorch_ooms"),
        ] {
            assert_eq!(j[ours], j[theirs], "{}: {ours}", trace.display());
        }
        let frag = j["fragmentation"].as_f64().unwrap();
        let expect = j["peak_reserved_bytes"].as_f64().unwrap()
            / j["peak_requested_bytes"].as_f64().unwrap();
        assert!((frag - expect).abs() < 1e-12);
        let hit = j["cache_hit_rate"].as_f64().unwrap();
        assert!((0.0..=1.0).contains(&hit));
    }
}

#[test]
fn the_human_report_puts_pytorch_beside_cachalot_and_says_they_match() {
    let out = cachalot(&[
        "replay",
        fixture("gpt2_train").to_str().unwrap(),
        "--pytorch",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(text.contains("matches PyTorch"), "{text}");
    assert!(text.contains("2,122,317,824 B"), "{text}");
    assert!(
        text.contains("empty_cache() would have given back"),
        "{text}"
    );
    assert!(text.contains("stranded in split segments"), "{text}");
}

#[test]
fn a_configuration_that_changes_the_outcome_reports_the_differences() {
    let trace = fixture("gpt2_train");
    let out = cachalot(&[
        "replay",
        trace.to_str().unwrap(),
        "--pytorch",
        "--config",
        "max_split_size_mb:64",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(text.contains("differs from PyTorch"), "{text}");
    assert!(text.contains("peak reserved: cachalot"), "{text}");
    let j = json(&cachalot(&[
        "replay",
        trace.to_str().unwrap(),
        "--config",
        "max_split_size_mb:64",
        "--json",
    ]));
    assert_eq!(j["pytorch_matches"], false);
    assert!(
        j["config"]
            .as_str()
            .unwrap()
            .contains("max_split_size_mb:64")
    );
}

#[test]
fn repeat_and_device_memory_are_honoured() {
    let j = json(&cachalot(&[
        "replay",
        fixture("two_stream").to_str().unwrap(),
        "--pytorch",
        "--repeat",
        "3",
        "--device-memory",
        "80GiB",
        "--json",
    ]));
    assert_eq!(j["repeat"], 3);
    assert_eq!(j["device_total_bytes"], 80u64 << 30);
    assert!(j["ns_per_op"].as_f64().unwrap() > 0.0);
}

/// The price is never hidden: with `--repeat N` the report gives the first pass's time and
/// calls and each later pass's calls — none under PyTorch's policy on a program that never
/// empties its cache, some in cachalot's policy's second pass on bert_infer (it makes the
/// views the first pass's layout asks for), then none.
#[test]
fn repeat_reports_the_first_pass_and_each_later_passs_device_calls() {
    let trace = fixture("bert_infer");
    let calls = |j: &serde_json::Value| -> Vec<u64> {
        j["steady_pass_device_calls"]
            .as_array()
            .expect("a list")
            .iter()
            .map(|v| v.as_u64().unwrap())
            .collect()
    };
    let pytorch = json(&cachalot(&[
        "replay",
        trace.to_str().unwrap(),
        "--pytorch",
        "--repeat",
        "4",
        "--json",
    ]));
    assert_eq!(calls(&pytorch), [0, 0, 0]);
    assert!(pytorch["first_pass_ns_per_op"].as_f64().unwrap() > 0.0);
    let own = json(&cachalot(&[
        "replay",
        trace.to_str().unwrap(),
        "--repeat",
        "4",
        "--json",
    ]));
    let later = calls(&own);
    assert_eq!(later.len(), 3);
    assert!(later[0] > 0 && later[1..] == [0, 0], "{later:?}");
    let text = stdout(&cachalot(&[
        "replay",
        trace.to_str().unwrap(),
        "--repeat",
        "2",
    ]));
    assert!(text.contains("first pass"), "{text}");
    assert!(text.contains("calls a pass"), "{text}");
    // One pass: no later passes to report.
    let once = json(&cachalot(&["replay", trace.to_str().unwrap(), "--json"]));
    assert!(calls(&once).is_empty());
}

fn assert_bad_input(out: &Output, mentions: &str) {
    let err = stderr(out);
    assert_eq!(out.status.code(), Some(2), "exit code; stderr: {err}");
    assert!(
        err.contains(mentions),
        "stderr does not name {mentions:?}: {err}"
    );
    assert!(!err.contains("panicked"), "{err}");
    assert!(out.stdout.is_empty(), "nothing on stdout: {}", stdout(out));
}

#[test]
fn bad_files_exit_with_code_2_and_a_message_naming_the_file() {
    let dir = scratch("bad-files");
    let original = std::fs::read(fixture("gpt2_train")).unwrap();
    let cases: [(&str, Vec<u8>, &str); 6] = [
        (
            "truncated.pickle",
            original[..original.len() / 2].to_vec(),
            "truncated",
        ),
        (
            "text.pickle",
            b"this is not a pickle at all\n".to_vec(),
            "not a pickle",
        ),
        ("empty.pickle", Vec::new(), ""),
        // protocol 4: an empty list, then STOP: a pickle, but not of a snapshot
        (
            "list.pickle",
            b"\x80\x04]\x94.".to_vec(),
            "not a PyTorch memory snapshot",
        ),
        // a dict without device_traces
        ("dict.pickle", b"\x80\x04}\x94.".to_vec(), ""),
        (
            "random.pickle",
            (0..4096u32)
                .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
                .collect(),
            "",
        ),
    ];
    for (name, bytes, what) in cases {
        let path = dir.join(name);
        std::fs::write(&path, bytes).unwrap();
        let out = cachalot(&["replay", path.to_str().unwrap()]);
        assert_bad_input(&out, path.to_str().unwrap());
        assert!(stderr(&out).contains(what), "{name}: {}", stderr(&out));
        let out = cachalot(&[
            "compare",
            path.to_str().unwrap(),
            "--config",
            "max_split_size_mb:64",
        ]);
        assert_bad_input(&out, path.to_str().unwrap());
    }
    let missing = dir.join("missing.pickle");
    assert_bad_input(
        &cachalot(&["replay", missing.to_str().unwrap()]),
        missing.to_str().unwrap(),
    );
    // A directory is not a snapshot either.
    assert_bad_input(
        &cachalot(&["replay", dir.to_str().unwrap()]),
        dir.to_str().unwrap(),
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_bad_config_exits_with_code_2_naming_the_key() {
    let trace = fixture("two_stream");
    let t = trace.to_str().unwrap();
    for (conf, key) in [
        ("max_split_size_mb:banana", "max_split_size_mb"),
        ("no_such_option:1", "no_such_option"),
        (
            "garbage_collection_threshold:1.5",
            "garbage_collection_threshold",
        ),
        ("roundup_power2_divisions:3", "roundup_power2_divisions"),
    ] {
        assert_bad_input(&cachalot(&["replay", t, "--config", conf]), key);
        assert_bad_input(&cachalot(&["compare", t, "--config", conf]), key);
    }
    // Parsed, but not supported by the allocator: still the user's to fix.
    assert_bad_input(
        &cachalot(&[
            "replay",
            t,
            "--config",
            "pinned_use_cuda_host_register:True",
        ]),
        "pinned_use_cuda_host_register",
    );
    assert_bad_input(
        &cachalot(&["replay", t, "--config", "backend:cudaMallocAsync"]),
        "backend",
    );
    // A trace device that does not exist.
    assert_bad_input(&cachalot(&["replay", t, "--device", "7"]), "device 7");
}

#[test]
fn plot_writes_an_svg_timeline() {
    let dir = scratch("plot");
    let svg = dir.join("timeline.svg");
    let out = cachalot(&[
        "replay",
        fixture("gpt2_train").to_str().unwrap(),
        "--pytorch",
        "--plot",
        svg.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = std::fs::read_to_string(&svg).unwrap();
    assert!(text.starts_with("<svg"), "{}", &text[..100.min(text.len())]);
    for label in ["reserved", "allocated", "requested", "gpt2_train"] {
        assert!(text.contains(label), "no {label} in the plot");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The snapshot written with `--snapshot-out`, replayed on the simulated device with its own
/// segment addresses, gives the same peak reserved and the same final layout as the replay
/// that wrote it.
#[test]
fn snapshot_out_replays_to_the_same_peak_and_final_layout() {
    let dir = scratch("snapshot-out");
    for name in ["gpt2_train", "two_stream", "fraction_oom_retry"] {
        for file in [format!("{name}.pickle"), format!("{name}.pickle.gz")] {
            let snap = dir.join(&file);
            let original = json(&cachalot(&[
                "replay",
                fixture(name).to_str().unwrap(),
                "--pytorch",
                "--json",
                "--snapshot-out",
                snap.to_str().unwrap(),
            ]));
            let s = read_snapshot(&snap).unwrap();
            let recorded = s.allocator_settings.as_ref().expect("allocator settings");
            let settings = Settings::pytorch().apply(&recorded.alloc_conf).unwrap();
            assert_eq!(settings.to_string(), original["config"].as_str().unwrap());
            let trace = s.traces.iter().find(|t| !t.entries.is_empty()).unwrap();
            let program = replay_ops_with(trace, &ReplayOptions::from_settings(Some(recorded))).0;
            let config = ReplayConfig {
                settings,
                capacity: original["device_total_bytes"].as_u64().unwrap(),
                ..ReplayConfig::pytorch()
            };
            let again = replay(&program, &config).unwrap();
            assert_eq!(
                again.peak_reserved_bytes,
                original["peak_reserved_bytes"].as_u64().unwrap(),
                "{file}"
            );
            assert_eq!(
                again.peak_segments,
                original["peak_segments"].as_u64().unwrap(),
                "{file}"
            );
            assert_eq!(segment_states(&again.final_layout, 0), s.segments, "{file}");
            // The binary reads its own snapshot back too (no sidecar: cachalot's figures only).
            let j = json(&cachalot(&[
                "replay",
                snap.to_str().unwrap(),
                "--pytorch",
                "--json",
                "--device-memory",
                &original["device_total_bytes"].to_string(),
            ]));
            assert_eq!(j["peak_reserved_bytes"], original["peak_reserved_bytes"]);
            assert!(j.get("pytorch_matches").is_none());
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_gpu_replay_without_a_gpu_fails_cleanly() {
    if cachalot::cuda::device_count().is_ok_and(|n| n > 0) {
        println!("skipped: this machine has a GPU");
        return;
    }
    let out = cachalot(&[
        "replay",
        fixture("two_stream").to_str().unwrap(),
        "--backend",
        "cuda",
    ]);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("cuda"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}
