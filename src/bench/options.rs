//! `gpu_compare`'s command line.

use std::path::PathBuf;

use cachalot::Settings;
use clap::ArgAction;

/// The allocators, in the order they run.
pub const RUN_ORDER: [&str; 5] = [
    "cachalot-pytorch",
    "cachalot-expandable",
    "cachalot",
    "cuda-pool",
    "cumemalloc",
];

/// Where the allocators run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum BackendKind {
    /// The first CUDA device.
    Cuda,
    /// cachalot's simulated device.
    Sim,
}

/// The allocators to run, in [`RUN_ORDER`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Only(pub Vec<&'static str>);

/// The side-by-side GPU benchmark's Rust side (docs/GPU_BENCH.md): every `cachalot ops v1`
/// program given runs through cachalot's three allocators, CUDA's stream-ordered pool and
/// plain cuMemAlloc, each (allocator, trace) written as one `cachalot gpu-bench v1` JSON
/// object under OUT/runs/; then the hot loops (1 MiB alloc+free pairs from 1, 2, 4 and 8
/// threads).
#[derive(Debug, Clone, clap::Parser)]
#[command(name = "gpu_compare", args_override_self = true)]
pub struct Options {
    /// Where the results go (DIR/runs/*.json).
    #[arg(long, value_name = "DIR")]
    pub out: PathBuf,
    /// The GPU, or cachalot's simulated device (the pool and cuMemAlloc are skipped there).
    #[arg(long, value_enum, value_name = "cuda|sim", default_value_t = BackendKind::Cuda,
        hide_possible_values = true)]
    pub backend: BackendKind,
    /// Timed passes over each trace (the first is the fresh allocator's).
    #[arg(long, value_name = "N", default_value_t = 3, value_parser = at_least::<1>)]
    pub passes: u64,
    /// cuMemAlloc runs the first LINES lines after `s` only.
    #[arg(long, value_name = "LINES", default_value_t = 4000, value_parser = at_least::<1>)]
    pub malloc_prefix: u64,
    /// Only these of cachalot-pytorch, cachalot-expandable, cachalot, cuda-pool, cumemalloc
    /// (comma-separated; they run in that order).
    #[arg(long, value_name = "ALLOC,...", value_parser = parse_only, default_value = ALL)]
    pub only: Only,
    /// Alloc+free pairs of a hot loop, all threads together (cuMemAlloc does N/1000).
    #[arg(long, value_name = "N", default_value_t = 2_000_000, value_parser = at_least::<8>)]
    pub hot_pairs: u64,
    /// No hot loops.
    #[arg(id = "no_hot", long = "no-hot", action = ArgAction::SetFalse)]
    pub hot: bool,
    /// No trace runs (then no OPS needed).
    #[arg(id = "no_traces", long = "no-traces", action = ArgAction::SetFalse)]
    pub traces: bool,
    /// Settings over cachalot's policy for the `cachalot` allocator (e.g.
    /// reclaim_headroom:0.1), written into each run's notes.
    #[arg(long, value_name = "CONF", value_parser = cachalot_config)]
    pub cachalot_config: Option<String>,
    /// The `cachalot ops v1` programs (`cachalot replay --ops-out`, scripts/synthetic_ops.py);
    /// each trace is named by its file's stem.
    #[arg(value_name = "OPS", required_unless_present = "no_traces")]
    pub ops: Vec<PathBuf>,
}

/// Every allocator, as `--only` writes them.
const ALL: &str = "cachalot-pytorch,cachalot-expandable,cachalot,cuda-pool,cumemalloc";

fn at_least<const MIN: u64>(value: &str) -> Result<u64, String> {
    let n: u64 = value
        .parse()
        .map_err(|_| format!("not a whole number of at least {MIN}"))?;
    if n < MIN {
        return Err(format!("must be at least {MIN}"));
    }
    Ok(n)
}

fn parse_only(list: &str) -> Result<Only, String> {
    let mut only = Vec::new();
    for name in list.split(',').map(str::trim).filter(|n| !n.is_empty()) {
        let known = RUN_ORDER.iter().find(|&&k| k == name).ok_or_else(|| {
            format!(
                "unknown allocator {name:?} (known: {})",
                RUN_ORDER.join(", ")
            )
        })?;
        if !only.contains(known) {
            only.push(*known);
        }
    }
    if only.is_empty() {
        return Err("no allocator named".into());
    }
    // Keep the run order.
    Ok(Only(
        RUN_ORDER
            .iter()
            .copied()
            .filter(|k| only.contains(k))
            .collect(),
    ))
}

fn cachalot_config(conf: &str) -> Result<String, String> {
    Settings::cachalot()
        .apply(conf)
        .map_err(|e| e.to_string())?;
    Ok(conf.to_string())
}

impl Options {
    /// cachalot's settings for an allocator key (`None` for the baselines).
    pub fn cachalot_settings(&self, key: &str) -> Option<Settings> {
        match key {
            "cachalot-pytorch" => Some(Settings::pytorch()),
            "cachalot-expandable" => Some(
                Settings::pytorch()
                    .apply("expandable_segments:True")
                    .expect("a valid setting"),
            ),
            "cachalot" => Some(match &self.cachalot_config {
                // Checked when the options were read.
                Some(conf) => Settings::cachalot().apply(conf).ok()?,
                None => Settings::cachalot(),
            }),
            _ => None,
        }
    }
}
