//! `cachalot compare`: every trace under every setting, one table.
//!
//! The one rule: the first column is always the baseline — PyTorch's defaults plus the
//! settings each trace was recorded with, the replay that reproduces PyTorch — so every other
//! setting is read against what PyTorch really did.
//!
//! With no `--config`, the columns are the three allocators a user chooses between: PyTorch's
//! defaults (the baseline), PyTorch with `expandable_segments:True` (over the recorded
//! settings), and cachalot's own policy (`Settings::cachalot()`, rule 21 of ARCHITECTURE.md,
//! with only the recorded memory fraction kept).

use std::path::PathBuf;

use cachalot::Settings;
use cachalot_tools::replay::ReplayConfig;
use cachalot_tools::units::human;
use serde::Serialize;

use super::error::CliError;
use super::input::{self, Trace, apply_config};
use super::plot;
use super::replay::{BackendKind, Report, execute};

/// `cachalot compare`.
#[derive(Debug, clap::Args)]
pub struct CompareArgs {
    /// The snapshots to replay.
    #[arg(required = true)]
    pub traces: Vec<PathBuf>,
    /// Settings to compare, in PYTORCH_CUDA_ALLOC_CONF syntax (repeat the option for more).
    /// The first column is always the baseline: PyTorch's defaults plus the settings each
    /// trace was recorded with. Without any, the columns are the baseline, PyTorch with
    /// expandable segments, and cachalot's own policy. "driver calls" counts device
    /// allocations and frees, or page map and unmap steps under expandable segments, in the
    /// first pass; "later passes' calls" those of each pass after it (with --repeat).
    #[arg(long, value_name = "CONF")]
    pub config: Vec<String>,
    /// Apply each --config over PyTorch's defaults instead of cachalot's.
    #[arg(long)]
    pub pytorch: bool,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    pub json: bool,
    /// Draw the fragmentation of every trace under every setting as grouped bars (SVG).
    #[arg(long, value_name = "FILE.svg")]
    pub plot: Option<PathBuf>,
    /// Passes over each trace (passes after the first measure steady-state speed).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub repeat: u32,
    /// The memory fraction the programs set (torch.cuda.set_per_process_memory_fraction), in
    /// force in every column.
    #[arg(long, value_name = "F", value_parser = super::replay::parse_fraction)]
    pub memory_fraction: Option<f64>,
}

/// The baseline column's label.
const BASELINE: &str = "PyTorch (recorded settings)";
/// The default second column's label.
const PYTORCH_EXPANDABLE: &str = "PyTorch + expandable_segments:True";
/// The default third column's label.
const CACHALOT_POLICY: &str = "cachalot's policy";

/// One column: the settings a trace is replayed under.
struct Column {
    label: String,
    /// Start from PyTorch's defaults (else cachalot's).
    pytorch: bool,
    /// Apply the settings the trace was recorded with.
    recorded: bool,
    /// A configuration string applied last.
    config: Option<String>,
}

/// The columns of a comparison: the baseline, then each `--config`, or the default three.
fn columns(args: &CompareArgs) -> Vec<Column> {
    let mut cols = vec![Column {
        label: BASELINE.into(),
        pytorch: true,
        recorded: true,
        config: None,
    }];
    if args.config.is_empty() {
        cols.push(Column {
            label: PYTORCH_EXPANDABLE.into(),
            pytorch: true,
            recorded: true,
            config: Some("expandable_segments:True".into()),
        });
        cols.push(Column {
            label: CACHALOT_POLICY.into(),
            pytorch: false,
            recorded: false,
            config: None,
        });
    }
    cols.extend(args.config.iter().map(|c| Column {
        label: c.clone(),
        pytorch: args.pytorch,
        recorded: false,
        config: Some(c.clone()),
    }));
    cols
}

/// The JSON form of a comparison.
#[derive(Debug, Serialize)]
struct CompareJson {
    /// The column labels, baseline first.
    configs: Vec<String>,
    /// Per trace, one report per column.
    traces: Vec<TraceRow>,
    /// Per column, the geometric mean of fragmentation over the traces.
    geomean_fragmentation: Vec<f64>,
}

#[derive(Debug, Serialize)]
struct TraceRow {
    trace: String,
    results: Vec<Report>,
}

/// Runs `cachalot compare`.
pub fn run(args: &CompareArgs) -> Result<(), CliError> {
    // Refuse a bad setting before replaying anything.
    for conf in &args.config {
        apply_config(&Settings::pytorch(), conf)?;
    }
    let cols = columns(args);
    let labels: Vec<String> = cols.iter().map(|c| c.label.clone()).collect();
    let mut rows = Vec::new();
    for path in &args.traces {
        let mut trace = input::load(path, None)?;
        trace.fraction = args.memory_fraction;
        let mut results = Vec::new();
        for c in &cols {
            let settings = trace.settings(c.pytorch, c.recorded, c.config.as_deref())?;
            results.push(one(&trace, settings, args.repeat)?);
        }
        rows.push(TraceRow {
            trace: trace.name(),
            results,
        });
    }
    let geomean: Vec<f64> = (0..labels.len())
        .map(|c| geometric_mean(rows.iter().map(|r| r.results[c].fragmentation)))
        .collect();
    if let Some(path) = &args.plot {
        let names: Vec<String> = rows.iter().map(|r| stem(&r.trace)).collect();
        let values: Vec<Vec<f64>> = rows
            .iter()
            .map(|r| r.results.iter().map(|x| x.fragmentation).collect())
            .collect();
        plot::fragmentation_bars(
            path,
            "fragmentation: peak reserved / peak requested",
            &names,
            &labels,
            &values,
        )?;
    }
    if args.json {
        let json = CompareJson {
            configs: labels,
            traces: rows,
            geomean_fragmentation: geomean,
        };
        let text = serde_json::to_string_pretty(&json)
            .map_err(|e| CliError::run(format!("cannot format the JSON report: {e}")))?;
        println!("{text}");
    } else {
        println!("{}", table(&labels, &rows, &geomean));
    }
    Ok(())
}

fn one(trace: &Trace, settings: Settings, repeat: u32) -> Result<Report, CliError> {
    let config = ReplayConfig {
        settings: settings.clone(),
        capacity: trace.capacity(None),
        trace_addresses: true,
        repeat: repeat as usize,
        timeline: false,
        record_history: false,
        start: super::replay::start_mode(trace, &settings),
    };
    let run = execute(trace, &config, BackendKind::Sim, 0)?;
    Ok(Report::new(trace, &config, &run))
}

fn stem(path: &str) -> String {
    let name = path.rsplit('/').next().unwrap_or(path);
    let name = name.strip_suffix(".gz").unwrap_or(name);
    name.strip_suffix(".pickle").unwrap_or(name).to_string()
}

/// The geometric mean (1.0 for none).
pub fn geometric_mean(values: impl Iterator<Item = f64>) -> f64 {
    let (sum, n) = values
        .filter(|v| *v > 0.0 && v.is_finite())
        .fold((0.0, 0usize), |(s, n), v| (s + v.ln(), n + 1));
    if n == 0 { 1.0 } else { (sum / n as f64).exp() }
}

/// The comparison as a Markdown table (aligned, so it reads as well in a terminal).
fn table(labels: &[String], rows: &[TraceRow], geomean: &[f64]) -> String {
    let header = [
        "trace",
        "settings",
        "peak reserved",
        "vs baseline",
        "fragmentation",
        "driver calls",
        "later passes' calls",
        "ns/op",
    ];
    let mut cells: Vec<Vec<String>> = Vec::new();
    for row in rows {
        let base = &row.results[0];
        for (c, r) in row.results.iter().enumerate() {
            let versus = if c == 0 {
                match &r.pytorch {
                    Some(p) if p.pytorch_peak_reserved_bytes == r.peak_reserved_bytes => {
                        "= PyTorch".to_string()
                    }
                    Some(p) => format!("PyTorch {}", human(p.pytorch_peak_reserved_bytes)),
                    None => String::new(),
                }
            } else {
                percent(r.peak_reserved_bytes, base.peak_reserved_bytes)
            };
            cells.push(vec![
                if c == 0 {
                    stem(&row.trace)
                } else {
                    String::new()
                },
                labels[c].clone(),
                human(r.peak_reserved_bytes),
                versus,
                format!("{:.3}", r.fragmentation),
                (r.device_allocs + r.device_frees).to_string(),
                if r.steady_pass_device_calls.is_empty() {
                    "–".to_string()
                } else {
                    r.steady_pass_device_calls
                        .iter()
                        .map(u64::to_string)
                        .collect::<Vec<_>>()
                        .join(" ")
                },
                format!("{:.0}", r.ns_per_op),
            ]);
        }
    }
    let mut out = markdown(
        &header,
        &cells,
        &[false, false, true, true, true, true, true, true],
    );
    out.push_str("\n\n");
    let gm: Vec<Vec<String>> = labels
        .iter()
        .zip(geomean)
        .map(|(l, g)| vec![l.clone(), format!("{g:.3}")])
        .collect();
    out.push_str(&markdown(
        &["settings", "geometric mean of fragmentation"],
        &gm,
        &[false, true],
    ));
    out
}

fn percent(value: u64, base: u64) -> String {
    if base == 0 {
        return String::new();
    }
    let d = (value as f64 - base as f64) / base as f64 * 100.0;
    if d.abs() < 0.05 {
        "±0%".into()
    } else {
        format!("{d:+.1}%")
    }
}

fn markdown(header: &[&str], rows: &[Vec<String>], right: &[bool]) -> String {
    let widths: Vec<usize> = (0..header.len())
        .map(|i| {
            rows.iter()
                .map(|r| r[i].chars().count())
                .chain([header[i].chars().count(), 3])
                .max()
                .unwrap_or(3)
        })
        .collect();
    let fmt_row = |cells: &[String]| {
        let mut s = String::from("|");
        for (i, c) in cells.iter().enumerate() {
            let pad = widths[i] - c.chars().count();
            if right[i] {
                s.push_str(&format!(" {}{} |", " ".repeat(pad), c));
            } else {
                s.push_str(&format!(" {}{} |", c, " ".repeat(pad)));
            }
        }
        s
    };
    let mut lines = vec![fmt_row(
        &header.iter().map(|h| h.to_string()).collect::<Vec<_>>(),
    )];
    let mut rule = String::from("|");
    for (i, w) in widths.iter().enumerate() {
        if right[i] {
            rule.push_str(&format!(" {}: |", "-".repeat(w - 1)));
        } else {
            rule.push_str(&format!(" {} |", "-".repeat(*w)));
        }
    }
    lines.push(rule);
    lines.extend(rows.iter().map(|r| fmt_row(r)));
    lines.join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_geometric_mean_of_ratios() {
        assert!((geometric_mean([1.0, 4.0].into_iter()) - 2.0).abs() < 1e-12);
        assert_eq!(geometric_mean(std::iter::empty()), 1.0);
        assert_eq!(stem("a/b/gpt2_train.pickle"), "gpt2_train");
        assert_eq!(stem("x.pickle.gz"), "x");
        assert_eq!(percent(110, 100), "+10.0%");
        assert_eq!(percent(100, 100), "±0%");
    }
}
