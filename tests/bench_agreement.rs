//! The side-by-side benchmark (`cachalot_tools::bench`, the program `gpu_compare`;
//! docs/GPU_BENCH.md) on the simulated device agrees with `cachalot replay` and `cachalot compare` on the programs
//! `cachalot replay --ops-out` writes: the same policy running the same program through the
//! thread-safe front end holds exactly what the replay's policy core holds — PyTorch's
//! settings, with expandable segments, and cachalot's own policy with thread caches off — with
//! the same peak requested bytes, allocations and driver calls. With thread caches on (what the
//! benchmark runs for `cachalot`) the figures may differ; the test prints both.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use cachalot::Settings;
use cachalot_tools::bench::allocators::sim_cachalot;
use cachalot_tools::bench::gpu_compare::run;
use cachalot_tools::bench::interpret::observed_pass;
use cachalot_tools::bench::options::Options;
use cachalot_tools::bench::record::TraceRun;
use cachalot_tools::ops::OpsProgram;
use clap::Parser;
use common::traces;

/// Traces with held-back frees (two_stream), `empty_cache` calls (empty_cache_loop) and
/// neither (bert_infer), all recorded with PyTorch's defaults.
const TRACES: [&str; 3] = ["bert_infer", "two_stream", "empty_cache_loop"];

fn cachalot(args: &[&str]) -> serde_json::Value {
    let o = Command::new(env!("CARGO_BIN_EXE_cachalot"))
        .args(args)
        .output()
        .expect("the cachalot binary runs");
    assert!(
        o.status.success(),
        "cachalot {args:?} failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    serde_json::from_slice(&o.stdout).expect("one JSON object")
}

fn scratch(test: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "cachalot-gpu-compare-{}-{test}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn result(out: &Path, allocator: &str, trace: &str) -> TraceRun {
    let path = out.join("runs").join(format!("{allocator}__{trace}.json"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn u64_of(v: &serde_json::Value, key: &str) -> u64 {
    v[key]
        .as_u64()
        .unwrap_or_else(|| panic!("no {key} in the report"))
}

#[test]
fn the_benchmark_on_the_simulated_device_holds_what_the_replay_holds() {
    let dir = scratch("agree");
    let out = dir.join("out");
    let mut args: Vec<String> = [
        "gpu_compare",
        "--backend",
        "sim",
        "--out",
        out.to_str().unwrap(),
        "--no-hot",
        "--passes",
        "2",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let mut reports = Vec::new();
    for name in TRACES {
        let pickle = traces().join(format!("{name}.pickle"));
        let ops = dir.join(format!("{name}.ops"));
        let (pickle, ops_s) = (pickle.to_str().unwrap(), ops.to_str().unwrap());
        let replay = cachalot(&["replay", pickle, "--pytorch", "--json", "--ops-out", ops_s]);
        assert_eq!(replay["config"], Settings::pytorch().to_string(), "{name}");
        let compare = cachalot(&["compare", pickle, "--json"]);
        args.push(ops_s.to_string());
        reports.push((name, ops, replay, compare));
    }
    run(&Options::try_parse_from(&args).unwrap())
        .unwrap_or_else(|e| panic!("gpu_compare failed: {e}"));

    for (name, ops, replay, compare) in &reports {
        let results = compare["traces"][0]["results"]
            .as_array()
            .expect("compare's results");
        // PyTorch's settings: the replay's figures, exactly.
        let pytorch = result(&out, "cachalot-pytorch", name);
        assert_eq!(
            pytorch.peak_reserved,
            u64_of(replay, "peak_reserved_bytes"),
            "{name}"
        );
        assert_eq!(
            pytorch.peak_allocated,
            Some(u64_of(replay, "peak_allocated_bytes")),
            "{name}"
        );
        assert_eq!(
            pytorch.peak_requested,
            u64_of(replay, "peak_requested_bytes"),
            "{name}"
        );
        assert_eq!(pytorch.allocs, u64_of(replay, "allocs"), "{name}");
        assert_eq!(pytorch.ooms, u64_of(replay, "ooms"), "{name}");
        assert_eq!(
            pytorch.driver_calls,
            Some(u64_of(replay, "device_allocs") + u64_of(replay, "device_frees")),
            "{name}"
        );
        let rate = replay["cache_hit_rate"].as_f64().unwrap();
        assert_eq!(
            pytorch.cache_hits.unwrap(),
            (rate * pytorch.allocs as f64).round() as u64,
            "{name}"
        );
        assert_eq!(pytorch.passes, 2);
        assert!(pytorch.ns_per_op_steady.is_some());
        let timeline = pytorch.timeline.as_ref().unwrap();
        assert!(timeline.line.len() <= 1000);
        assert_eq!(
            timeline.reserved.iter().max().copied(),
            Some(pytorch.peak_reserved),
            "{name}: the timeline keeps each bucket's maximum"
        );

        // PyTorch's settings with expandable segments: compare's second column.
        let expandable = result(&out, "cachalot-expandable", name);
        assert_eq!(
            results[1]["config"],
            Settings::pytorch()
                .apply("expandable_segments:True")
                .unwrap()
                .to_string()
        );
        assert_eq!(
            expandable.peak_reserved,
            u64_of(&results[1], "peak_reserved_bytes"),
            "{name}"
        );
        assert_eq!(expandable.peak_requested, pytorch.peak_requested, "{name}");

        // cachalot's policy through the front end with thread caches off: compare's third
        // column (the replay drives the policy core, which has no thread caches).
        let program = OpsProgram::read(ops).unwrap();
        let mut settings = Settings::cachalot();
        settings.thread_cache_blocks = 0;
        let mut target = sim_cachalot(settings, &program).unwrap();
        let core = observed_pass(&mut target, &program, program.trace.len()).unwrap();
        let own = u64_of(&results[2], "peak_reserved_bytes");
        assert_eq!(core.peak_reserved, own, "{name}");
        assert_eq!(
            core.driver_calls.as_ref().map(|c| c.0),
            Some(u64_of(&results[2], "device_allocs") + u64_of(&results[2], "device_frees")),
            "{name}"
        );

        // With thread caches (the benchmark's `cachalot`): reported, not required to agree.
        let cached = result(&out, "cachalot", name);
        assert_eq!(cached.peak_requested, pytorch.peak_requested, "{name}");
        eprintln!(
            "{name}: cachalot's policy, peak reserved {} with thread caches (front end), {} \
             without (= cachalot compare); driver calls {:?} / {:?}",
            cached.peak_reserved,
            own,
            cached.driver_calls,
            core.driver_calls.map(|c| c.0)
        );
    }
}
