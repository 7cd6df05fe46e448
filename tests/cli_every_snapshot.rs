//! `cachalot replay` on issue 23's snapshots as a user without PyTorch's figures has them (the
//! pickle alone, no NAME.json beside it): the fraction a program set is given or found, the
//! self-check names what it cannot model, and every real snapshot is read.

use std::path::PathBuf;
use std::process::{Command, Output};

mod common;
use common::fixtures_root;

fn cachalot(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_cachalot"))
        .args(args)
        .output()
        .expect("the cachalot binary runs")
}

/// `tests/fixtures/user/NAME.pickle.gz` copied alone into a scratch folder (no sidecar).
fn alone(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("cachalot-every-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let to = dir.join(format!("{name}.pickle.gz"));
    std::fs::copy(
        fixtures_root()
            .join("user")
            .join(format!("{name}.pickle.gz")),
        &to,
    )
    .unwrap();
    to
}

fn json(o: &Output) -> serde_json::Value {
    assert!(
        o.status.success(),
        "cachalot failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    serde_json::from_slice(&o.stdout).expect("one JSON object on stdout")
}

fn sidecar(name: &str) -> serde_json::Value {
    let path = fixtures_root().join("user").join(format!("{name}.json"));
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// `cachalot replay PATH --pytorch --json` with `extra` arguments: the report.
fn replay(path: &std::path::Path, extra: &[&str]) -> serde_json::Value {
    let mut args = vec!["replay", path.to_str().unwrap(), "--pytorch", "--json"];
    args.extend_from_slice(extra);
    json(&cachalot(&args))
}

/// The report's peaks are PyTorch's (`dev`: the sidecar's device) to the byte, and the
/// replay ends in the dump.
fn assert_pytorchs_figures(report: &serde_json::Value, dev: &serde_json::Value) {
    assert_eq!(report["peak_reserved_bytes"], dev["max_memory_reserved"]);
    assert_eq!(report["peak_allocated_bytes"], dev["max_memory_allocated"]);
    assert_eq!(
        report["self_check"]["matches"], true,
        "{}",
        report["self_check"]
    );
}

#[test]
fn frees_nothing_explains_are_named_and_the_fraction_is_found() {
    let path = alone("resnet50_fraction");
    let path = path.to_str().unwrap();
    let out = cachalot(&["replay", path, "--pytorch"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success());
    assert!(text.contains("frees the replay cannot explain"), "{text}");
    assert!(text.contains("set_per_process_memory_fraction"), "{text}");
    assert!(text.contains("fraction   found"), "{text}");
    let report = json(&cachalot(&["replay", path, "--pytorch", "--json"]));
    let found = &report["unexplained_frees"];
    assert_eq!(found["trace_frees"], 32);
    assert!(found["found_cap_bytes"].as_u64().unwrap() <= 5 << 30);
}

#[test]
fn the_fraction_the_program_set_reproduces_pytorch_to_the_byte() {
    let name = "resnet50_fraction";
    let side = sidecar(name);
    let dev = &side["devices"][0];
    // The user's card: the fraction is of the recording GPU's memory.
    let fraction = format!("{}", side["memory_fraction"].as_f64().unwrap());
    let memory = format!("{}", side["device_total_memory"].as_u64().unwrap());
    let path = alone(name);
    let path = path.to_str().unwrap();
    for cmd in [
        vec!["replay", path, "--pytorch", "--json"],
        vec![
            "replay",
            path,
            "--pytorch",
            "--json",
            "--device-memory",
            &memory,
        ],
    ] {
        let mut args = cmd.clone();
        args.extend(["--memory-fraction", &fraction]);
        let report = json(&cachalot(&args));
        if cmd.len() == 4 {
            // On an H200 of another size than the recording one, the cap differs: only check
            // that the fraction is in force.
            assert_eq!(
                report["memory_fraction"].as_f64(),
                side["memory_fraction"].as_f64()
            );
            continue;
        }
        assert_eq!(report["peak_reserved_bytes"], dev["max_memory_reserved"]);
        assert_eq!(report["peak_allocated_bytes"], dev["max_memory_allocated"]);
        assert_eq!(report["device_frees"], 32);
        assert_eq!(report["self_check"]["matches"], true, "{report}");
        assert!(report.get("unexplained_frees").is_none());
    }
    // And `compare` takes it too: its baseline is then PyTorch's run.
    let out = cachalot(&["compare", path, "--json", "--memory-fraction", &fraction]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // A fraction out of range is bad input.
    let bad = cachalot(&["replay", path, "--memory-fraction", "1.5"]);
    assert_eq!(bad.status.code(), Some(2));
}

/// A self-check that passes still names what the replay inferred that no trace entry records:
/// a settings change at run time, a private pool released before the dump (in JSON, and in
/// the text under the self-check line); the dumped private pools stay among the causes.
#[test]
fn the_self_check_names_what_it_cannot_model() {
    let cases = [
        ("mempool_mlp", "private pool released at trace entry"),
        ("settings_runtime", "settings changed at run time"),
    ];
    for (name, what) in cases {
        let path = alone(name);
        let report = json(&cachalot(&[
            "replay",
            path.to_str().unwrap(),
            "--pytorch",
            "--json",
        ]));
        assert_eq!(report["self_check"]["matches"], true, "{name}");
        let inferred = report["self_check"]["inferred"].as_array().unwrap();
        assert!(
            inferred.iter().any(|c| c.as_str().unwrap().contains(what)),
            "{name}: {inferred:?}"
        );
        let text = cachalot(&["replay", path.to_str().unwrap(), "--pytorch"]);
        let text = String::from_utf8_lossy(&text.stdout);
        assert!(
            text.contains(&format!("inferred: {what}")),
            "{name}: {text}"
        );
    }
    let report = json(&cachalot(&[
        "replay",
        alone("mempool_mlp").to_str().unwrap(),
        "--pytorch",
        "--json",
    ]));
    let causes = report["self_check"]["causes"].as_array().unwrap();
    assert!(
        causes
            .iter()
            .any(|c| c.as_str().unwrap().starts_with("private pools")),
        "{causes:?}"
    );
}

/// settings_runtime: the program called `_set_allocator_settings` after the allocation the
/// sidecar names (`settings_changed_after`, which only the recording script knew); the search
/// finds the change between that allocation and the next, from PyTorch's defaults to the
/// recorded settings, and the replay gets PyTorch's peaks to the byte.
#[test]
fn a_settings_change_at_run_time_is_found_where_the_program_made_it() {
    let name = "settings_runtime";
    let side = sidecar(name);
    let dev = &side["devices"][0];
    let path = alone(name);
    let report = replay(&path, &[]);
    assert_pytorchs_figures(&report, dev);
    let change = &report["settings_change"];
    assert_eq!(change["from"], "");
    assert_eq!(change["to"], side["settings_changed_to"]);
    // The allocation the change came after, and the next allocation.
    let snapshot = cachalot_tools::snapshot::read_snapshot(&path).unwrap();
    let entries = &snapshot.traces[0].entries;
    let after = &side["settings_changed_after"][0];
    let at = entries
        .iter()
        .position(|e| {
            e.action == cachalot_tools::snapshot::Action::Alloc
                && Some(e.addr) == after["addr"].as_u64()
                && Some(e.size) == after["size"].as_u64()
        })
        .expect("the sidecar's allocation is in the trace");
    let next = (at + 1..entries.len())
        .find(|&i| entries[i].action == cachalot_tools::snapshot::Action::Alloc)
        .unwrap();
    let first = change["first_entry"].as_u64().unwrap() as usize;
    assert!(at < first && first <= next, "{at} < {first} <= {next}");
    // Said by the user instead, at that entry: the same figures; at an entry far before it,
    // the walk back fails and the self-check does not pass.
    let conf = format!("{first}:{}", side["settings_changed_to"].as_str().unwrap());
    let given = replay(&path, &["--settings-at", &conf]);
    assert_pytorchs_figures(&given, dev);
    let early = format!("10:{}", side["settings_changed_to"].as_str().unwrap());
    let wrong = replay(&path, &["--settings-at", &early]);
    assert_ne!(wrong["self_check"]["matches"], true);
}

/// `--settings-at` refuses what is not ENTRY:CONF, a bad configuration and an entry beyond
/// the trace, with exit code 2 and a message naming the value.
#[test]
fn a_bad_settings_at_is_bad_input() {
    let path = alone("settings_runtime");
    for (bad, says) in [
        ("302", "not ENTRY:CONF"),
        ("x:max_split_size_mb:32", "not a trace entry"),
        ("302:max_split_size_mb:1", "max_split_size_mb"),
        ("302:no_such_key:1", "no_such_key"),
        ("99999:max_split_size_mb:32", "entries"),
        (":", "not a trace entry"),
    ] {
        let out = cachalot(&[
            "replay",
            path.to_str().unwrap(),
            "--pytorch",
            "--settings-at",
            bad,
        ]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{bad}: {err}");
        assert!(
            err.contains(says) && !err.contains("panicked"),
            "{bad}: {err}"
        );
    }
}

/// mempool_mlp: the MemPool's three segments, released when it was deleted, are in no dump;
/// the replay infers the pool from the trace, replays its allocations in it and releases it at
/// that point, to PyTorch's peaks, device frees and dump.
#[test]
fn a_mempool_deleted_before_the_dump_is_inferred_and_released() {
    let name = "mempool_mlp";
    let dev = &sidecar(name)["devices"][0];
    let path = alone(name);
    let report = replay(&path, &[]);
    assert_pytorchs_figures(&report, dev);
    assert_eq!(
        report["device_frees"],
        dev["memory_stats"]["num_device_free"]
    );
    let pools = report["inferred_pools"].as_array().unwrap();
    assert_eq!(pools.len(), 1, "{pools:?}");
    let snapshot = cachalot_tools::snapshot::read_snapshot(&path).unwrap();
    let first_free = snapshot.traces[0]
        .entries
        .iter()
        .position(|e| e.action == cachalot_tools::snapshot::Action::SegmentFree)
        .unwrap();
    assert_eq!(pools[0]["entry"], first_free);
    assert_eq!(pools[0]["segments"], 3);
    assert_eq!(
        pools[0]["bytes"],
        dev["memory_stats"]["reserved_bytes.all.freed"]
    );
    // The ops format cannot say a pool's release: the program is written without it, and
    // both the file's header and the warning say what was left out.
    let ops = std::env::temp_dir().join(format!("cachalot-every-{}-m.ops", std::process::id()));
    let out = cachalot(&[
        "replay",
        path.to_str().unwrap(),
        "--pytorch",
        "--ops-out",
        ops.to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stderr).contains("1 private pool release(s)"));
    let program = cachalot_tools::ops::OpsProgram::read(&ops).unwrap();
    let _ = std::fs::remove_file(&ops);
    assert!(
        program
            .header_value("left_out")
            .is_some_and(|l| l.contains("private pool release")),
        "{:?}",
        program.header
    );
}

/// A mid-run start under expandable segments, the pickle alone (no figures beside it): the
/// ranges held when recording began are rebuilt and adopted (rule 18f), the replay gets
/// PyTorch's peaks to the byte and ends in the dump.
#[test]
fn a_mid_run_start_under_expandable_segments_is_rebuilt_from_the_pickle_alone() {
    let name = "lstm_expandable_warm";
    let dev = &sidecar(name)["devices"][0];
    let path = alone(name);
    let report = replay(&path, &[]);
    assert_eq!(
        report["start"]["replayed_from"], "exact",
        "{}",
        report["start"]
    );
    assert_pytorchs_figures(&report, dev);
    let text = cachalot(&["replay", path.to_str().unwrap(), "--pytorch"]);
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(
        text.contains("replayed from that state, block for block"),
        "{text}"
    );
}

#[test]
fn every_new_snapshot_is_read_and_replayed() {
    for name in [
        "diffusion_wrapped",
        "diffusion_multires_wrapped",
        "gpt2_bf16_wrapped",
        "lstm_expandable_warm",
        "cuda_graph_mlp",
        "mempool_mlp",
        "compile_reduce_overhead",
        "resnet50_fraction",
        "settings_runtime",
    ] {
        let path = fixtures_root()
            .join("user")
            .join(format!("{name}.pickle.gz"));
        let report = json(&cachalot(&[
            "replay",
            path.to_str().unwrap(),
            "--pytorch",
            "--json",
        ]));
        assert_eq!(
            report["self_check"]["matches"].as_bool(),
            Some(true),
            "{name}: {}",
            report["self_check"]
        );
    }
}

#[test]
fn a_replays_snapshot_puts_private_pools_blocks_back_in_their_pools() {
    let path = fixtures_root()
        .join("user")
        .join("cuda_graph_mlp.pickle.gz");
    let out_path =
        std::env::temp_dir().join(format!("cachalot-every-{}-g.pickle", std::process::id()));
    let out = cachalot(&[
        "replay",
        path.to_str().unwrap(),
        "--pytorch",
        "--snapshot-out",
        out_path.to_str().unwrap(),
    ]);
    assert!(out.status.success());
    let ours = cachalot_tools::snapshot::read_snapshot(&out_path).unwrap();
    let theirs = cachalot_tools::snapshot::read_snapshot(&path).unwrap();
    let key = |s: &cachalot_tools::snapshot::Snapshot| {
        let mut v: Vec<_> = s
            .segments
            .iter()
            .map(|s| (s.address, s.stream, s.pool_id))
            .collect();
        v.sort();
        v
    };
    assert_eq!(key(&ours), key(&theirs));
}
