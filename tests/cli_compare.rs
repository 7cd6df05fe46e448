//! `cachalot compare`: every trace under every setting, the baseline first, in one table, as
//! JSON and as grouped bars.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn fixture(name: &str) -> PathBuf {
    let local = Path::new("tests/fixtures/traces");
    let dir = if local.is_dir() {
        local.to_path_buf()
    } else {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/traces")
    };
    dir.join(format!("{name}.pickle"))
}

fn cachalot(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_cachalot"))
        .args(args)
        .output()
        .expect("the cachalot binary runs")
}

#[test]
fn compare_prints_one_row_per_trace_and_setting_with_the_baseline_first() {
    let (a, b) = (fixture("two_stream"), fixture("oversize_max_split"));
    let out = cachalot(&[
        "compare",
        a.to_str().unwrap(),
        b.to_str().unwrap(),
        "--config",
        "max_split_size_mb:64",
        "--config",
        "roundup_power2_divisions:4",
    ]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("| ") && !l.starts_with("| -"))
        .collect();
    // header + 2 traces x 3 settings, then header + 3 geometric means
    assert_eq!(rows.len(), 1 + 6 + 1 + 3, "{text}");
    assert!(rows[1].contains("two_stream") && rows[1].contains("PyTorch (recorded settings)"));
    assert!(rows[1].contains("= PyTorch"), "{text}");
    assert!(rows[4].contains("oversize_max_split") && rows[4].contains("= PyTorch"));
    assert!(text.contains("geometric mean of fragmentation"));
}

#[test]
fn compare_json_and_plot() {
    let dir = std::env::temp_dir().join(format!("cachalot-compare-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let svg = dir.join("bars.svg");
    let t = fixture("gpt2_train");
    let out = cachalot(&[
        "compare",
        t.to_str().unwrap(),
        "--config",
        "max_split_size_mb:64",
        "--json",
        "--plot",
        svg.to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(j["configs"][0], "PyTorch (recorded settings)");
    assert_eq!(j["configs"][1], "max_split_size_mb:64");
    let results = &j["traces"][0]["results"];
    assert_eq!(results[0]["pytorch_matches"], true);
    assert_eq!(results[0]["peak_reserved_bytes"], 2_122_317_824u64);
    let gm = j["geomean_fragmentation"].as_array().unwrap();
    assert_eq!(gm.len(), 2);
    assert_eq!(gm[0], results[0]["fragmentation"]);
    let text = std::fs::read_to_string(&svg).unwrap();
    assert!(text.starts_with("<svg") && text.contains("gpt2_train"));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn compare_needs_a_trace() {
    let out = cachalot(&["compare", "--config", "max_split_size_mb:64"]);
    assert_eq!(out.status.code(), Some(2));
}

#[test]
fn compare_without_config_sets_cachalots_policy_beside_pytorchs_two() {
    let t = fixture("bert_infer");
    let out = cachalot(&["compare", t.to_str().unwrap(), "--json"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let configs: Vec<&str> = j["configs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c.as_str().unwrap())
        .collect();
    assert_eq!(
        configs,
        [
            "PyTorch (recorded settings)",
            "PyTorch + expandable_segments:True",
            "cachalot's policy"
        ]
    );
    let r = &j["traces"][0]["results"];
    let peak = |i: usize| r[i]["peak_reserved_bytes"].as_u64().unwrap();
    // bert_infer (variable shapes) is where PyTorch strands the most: its expandable
    // segments hold less than its defaults, and cachalot's policy less than both, within
    // rule 20's 2.5 % of the peak requested bytes plus one 2 MiB page — and, since rule 23f's
    // reclaim takes no page of the other pool, plus the small pool's free pages (under 1 % of
    // bert_infer's peak).
    assert!(peak(1) < peak(0), "{r}");
    assert!(peak(2) < peak(1), "{r}");
    let requested = r[2]["peak_requested_bytes"].as_u64().unwrap();
    assert!(
        peak(2) as f64 <= requested as f64 * 1.035 + (2 << 20) as f64,
        "{r}"
    );
    assert_eq!(r[2]["config"], "");
}

/// With --repeat, every row shows each later pass's device calls beside the first pass's:
/// none for PyTorch's policy on a program that never empties its cache; one figure per pass.
#[test]
fn compare_with_repeat_shows_each_later_passs_calls() {
    let t = fixture("bert_infer");
    let out = cachalot(&["compare", t.to_str().unwrap(), "--repeat", "3"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("later passes' calls"), "{text}");
    let baseline = text
        .lines()
        .find(|l| l.contains("PyTorch (recorded settings)"))
        .expect("the baseline row");
    let cells: Vec<&str> = baseline.split('|').map(str::trim).collect();
    assert_eq!(cells[7], "0 0", "{baseline}");
    let own = text
        .lines()
        .find(|l| l.contains("cachalot's policy"))
        .expect("cachalot's row");
    let cells: Vec<&str> = own.split('|').map(str::trim).collect();
    assert_eq!(cells[7].split(' ').count(), 2, "{own}");
    // Without --repeat there are no later passes.
    let once = cachalot(&["compare", t.to_str().unwrap()]);
    let text = String::from_utf8_lossy(&once.stdout);
    assert!(
        text.lines()
            .filter(|l| l.contains("= PyTorch"))
            .all(|l| l.contains('–'))
    );
}
