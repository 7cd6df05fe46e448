//! `cachalot fit`: the smallest GPU a trace runs on without running out of memory, under each
//! policy of [`cachalot_tools::fit::POLICIES`], and with `--device-memory` a verdict for one
//! card (exit code 3 when the job does not fit under the first policy tried).
//!
//! The one rule: every figure is a replay's ([`cachalot_tools::fit`]); this module picks the
//! settings, the start and the limit from the trace and the options, and formats.

use std::path::PathBuf;

use cachalot_tools::explain::{Origin, frame_lines, origins, summarize};
use cachalot_tools::fit::{
    self, Attempt, GRANULE, Limit, POLICIES, Policy, Problem, Reserve, Search, default_reserve,
    min_device_bytes, usable_bytes,
};
use cachalot_tools::replay::{ReplayOp, StartMode};
use cachalot_tools::units::{grouped, human};
use serde::Serialize;

use super::error::CliError;
use super::input::{self, Trace};
use super::units;

/// How `cachalot fit` models the limit (see `cachalot_tools::fit::Limit`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum LimitArg {
    /// A card of the given size: device allocations fail when they do not fit.
    #[default]
    Device,
    /// A memory fraction on a device of the trace's size (what the GPU check runs).
    Fraction,
}

/// `cachalot fit`.
#[derive(Debug, clap::Args)]
pub struct FitArgs {
    /// The snapshot (a `torch.cuda.memory._dump_snapshot()` pickle, optionally gzipped).
    pub trace: PathBuf,
    /// Give a verdict for a device of this much memory (bytes; K, M, G, KiB, MiB, GiB …):
    /// fits (with the headroom) or not (with the first allocation that fails); exit code 3
    /// when the job does not fit under the first policy.
    #[arg(long, value_name = "BYTES", value_parser = units::parse_bytes)]
    pub device_memory: Option<u64>,
    /// Device memory PyTorch holds outside its allocator: the CUDA context and libraries.
    /// Default: the figure of results/fit/reserve.json, measured on an H200.
    #[arg(long, value_name = "BYTES", value_parser = parse_reserve)]
    pub reserve: Option<u64>,
    /// The memory fraction the job sets (`torch.cuda.set_per_process_memory_fraction`).
    /// Default: the one the trace was recorded with, if any.
    #[arg(long, value_name = "F")]
    pub memory_fraction: Option<f64>,
    /// Only these policies (repeat the option), in this order; the first decides the exit
    /// code of a verdict. Default: all of them (pytorch, expandable, cachalot).
    #[arg(long = "policy", value_name = "NAME", value_parser = parse_policy)]
    pub policies: Vec<&'static Policy>,
    /// One more row: the trace's recorded settings with these on top (PYTORCH_CUDA_ALLOC_CONF
    /// syntax).
    #[arg(long, value_name = "CONF")]
    pub config: Option<String>,
    /// How the limit stops the allocator: a card (`device`) or a memory fraction on the
    /// trace's device (`fraction`, what `scripts/fit_check.py` runs on the GPU).
    #[arg(long, value_enum, default_value_t = LimitArg::Device)]
    pub limit: LimitArg,
    /// Which device's trace of a multi-GPU snapshot.
    #[arg(long, value_name = "N")]
    pub device: Option<usize>,
    /// Print one JSON object instead of the report.
    #[arg(long)]
    pub json: bool,
}

fn parse_policy(s: &str) -> Result<&'static Policy, String> {
    fit::policy(s).ok_or_else(|| {
        let names: Vec<&str> = POLICIES.iter().map(|p| p.name).collect();
        format!("unknown policy \"{s}\" (policies: {})", names.join(", "))
    })
}

fn parse_reserve(s: &str) -> Result<u64, String> {
    if s.trim() == "0" {
        return Ok(0);
    }
    units::parse_bytes(s)
}

/// The JSON report.
#[derive(Debug, Serialize)]
pub struct FitReport {
    /// The trace file.
    pub trace: String,
    /// The device whose trace was replayed.
    pub device: usize,
    /// Operations in the program.
    pub ops: usize,
    /// What the replays start from: `fresh`, `live_tensors` or `empty`.
    pub start: &'static str,
    /// The reserve used (bytes outside the allocator).
    pub reserve_bytes: u64,
    /// Whether that reserve is the provisional default.
    pub reserve_provisional: bool,
    /// Where the reserve comes from.
    pub reserve_source: String,
    /// The memory fraction in force (the option's or the trace's).
    pub memory_fraction: Option<f64>,
    /// How the limit stops the allocator.
    pub limit: Limit,
    /// The step of the search.
    pub granularity_bytes: u64,
    /// The device of the verdict, when asked for.
    pub device_memory_bytes: Option<u64>,
    /// One row per policy.
    pub policies: Vec<PolicyFit>,
}

/// One policy's answer.
#[derive(Debug, Serialize)]
pub struct PolicyFit {
    /// The policy's name.
    pub name: String,
    /// For people.
    pub label: String,
    /// The settings replayed (canonical PYTORCH_CUDA_ALLOC_CONF, the fraction apart).
    pub settings: String,
    /// The smallest device (total memory) the job runs on: the allocator's need plus the
    /// reserve, or more under a memory fraction. `None`: no device is large enough.
    pub min_device_bytes: Option<u64>,
    /// The smallest capacity the allocator needs (a multiple of 2 MiB).
    pub min_allocator_bytes: Option<u64>,
    /// Under `--limit fraction`: the memory fraction that caps the allocator at
    /// `min_allocator_bytes` on the device of `fraction_device_bytes`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fraction: Option<f64>,
    /// The device the fraction applies to.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fraction_device_bytes: Option<u64>,
    /// Peak reserved bytes without a tight limit.
    pub unconstrained_peak_reserved_bytes: u64,
    /// Peak reserved bytes at the smallest capacity.
    pub peak_reserved_at_min_bytes: Option<u64>,
    /// Out-of-memory errors one step below the smallest capacity (at least 1).
    pub ooms_one_step_below: Option<u64>,
    /// Replays the search ran.
    pub replays: usize,
    /// The verdict for `--device-memory`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub verdict: Option<Verdict>,
}

/// Whether the job fits on the device asked about.
#[derive(Debug, Serialize)]
pub struct Verdict {
    /// Fits: no allocation fails.
    pub fits: bool,
    /// The bytes the allocator may use on that device.
    pub allocator_bytes: u64,
    /// Peak reserved bytes there.
    pub peak_reserved_bytes: u64,
    /// Fits: bytes the allocator never reached (`allocator_bytes − peak_reserved_bytes`).
    pub headroom_bytes: Option<u64>,
    /// Fits: how much smaller the device could be (`device − min_device_bytes`).
    pub spare_device_bytes: Option<u64>,
    /// Allocations that failed.
    pub ooms: u64,
    /// The tensors live when recording began did not all fit (they are allocated first).
    pub start_failed: bool,
    /// The first allocation of the trace that failed.
    pub first_failure: Option<Failure>,
}

/// An allocation that failed.
#[derive(Debug, Serialize)]
pub struct Failure {
    /// Its operation index in the program.
    pub op: usize,
    /// Its trace entry (`None` for a tensor of the start).
    pub trace_entry: Option<usize>,
    /// The bytes it asked for.
    pub size: u64,
    /// Its stream.
    pub stream: u64,
    /// Where it was made, for people.
    pub label: String,
    /// Its stack, innermost first.
    pub frames: Vec<String>,
}

/// Runs `cachalot fit`.
pub fn run(args: &FitArgs) -> Result<(), CliError> {
    let trace = input::load(&args.trace, args.device)?;
    let recorded = trace.settings(true, true, None)?;
    if let Some(f) = args.memory_fraction
        && !(0.0..=1.0).contains(&f)
    {
        return Err(CliError::input(format!(
            "--memory-fraction {f}: a memory fraction is between 0 and 1"
        )));
    }
    let mut rows: Vec<(String, String, cachalot::Settings)> = Vec::new();
    let chosen: Vec<&Policy> = if args.policies.is_empty() {
        POLICIES.iter().collect()
    } else {
        args.policies.clone()
    };
    for p in chosen {
        let s = (p.settings)(&recorded)
            .map_err(|e| CliError::input(format!("{}: policy {}: {e}", trace.name(), p.name)))?;
        rows.push((p.name.to_string(), p.label.to_string(), s));
    }
    if let Some(conf) = &args.config {
        let s = input::apply_config(&recorded, conf)?;
        rows.push((
            "config".to_string(),
            format!("the recorded settings + {conf}"),
            s,
        ));
    }
    let reserve = match args.reserve {
        Some(bytes) => Reserve {
            bytes,
            provisional: false,
            source: "--reserve".to_string(),
        },
        None => default_reserve(),
    };
    let (start, start_name) = fit_start(&trace);
    let roomy = trace.capacity(None);
    let limit = match args.limit {
        LimitArg::Device => Limit::Device,
        LimitArg::Fraction => Limit::Fraction {
            total: args.device_memory.unwrap_or(roomy),
        },
    };
    let origins = origins(&trace.snapshot, trace.device, &trace.program);
    let mut policies = Vec::new();
    let mut fraction_shown = None;
    for (name, label, settings) in rows {
        let fraction = args
            .memory_fraction
            .or(settings.per_process_memory_fraction);
        fraction_shown = fraction_shown.or(fraction);
        let mut bare = settings.clone();
        bare.per_process_memory_fraction = None;
        let problem = Problem {
            program: &trace.program,
            settings: bare.clone(),
            fraction_set: fraction.is_some(),
            start,
            limit,
        };
        let search = fit::search(&problem, roomy.max(GRANULE))
            .map_err(|e| CliError::run(format!("{}: {e}", trace.name())))?;
        let verdict = match (args.device_memory, limit) {
            (Some(total), Limit::Device) => Some(verdict(
                &trace, &problem, &search, &origins, total, &reserve, fraction,
            )?),
            _ => None,
        };
        let min_alloc = search.min_capacity;
        let (frac, frac_total) = match (limit, min_alloc) {
            (Limit::Fraction { total }, Some(c)) => {
                (Some(fit::fraction_for(c, total)), Some(total))
            }
            _ => (None, None),
        };
        policies.push(PolicyFit {
            name,
            label,
            settings: bare.to_string(),
            min_device_bytes: min_alloc.and_then(|c| min_device_bytes(c, reserve.bytes, fraction)),
            min_allocator_bytes: min_alloc,
            fraction: frac,
            fraction_device_bytes: frac_total,
            unconstrained_peak_reserved_bytes: search.unconstrained.peak_reserved_bytes,
            peak_reserved_at_min_bytes: search.at_min.as_ref().map(|a| a.peak_reserved_bytes),
            ooms_one_step_below: search.below.as_ref().map(|a| a.ooms),
            replays: search.replays,
            verdict,
        });
    }
    let report = FitReport {
        trace: trace.name(),
        device: trace.device,
        ops: trace.program.ops.len(),
        start: start_name,
        reserve_bytes: reserve.bytes,
        reserve_provisional: reserve.provisional,
        reserve_source: reserve.source.clone(),
        memory_fraction: fraction_shown,
        limit,
        granularity_bytes: GRANULE,
        device_memory_bytes: args.device_memory,
        policies,
    };
    let text = if args.json {
        serde_json::to_string_pretty(&report)
            .map_err(|e| CliError::run(format!("cannot format the JSON report: {e}")))?
    } else {
        human_report(&report, &trace)
    };
    super::explain::emit(&text)?;
    match report.policies.first().and_then(|p| p.verdict.as_ref()) {
        Some(v) if !v.fits => Err(CliError {
            code: 3,
            message: format!(
                "{} does not fit on a {} device under {}",
                trace.name(),
                human(report.device_memory_bytes.unwrap_or(0)),
                report.policies[0].label
            ),
        }),
        _ => Ok(()),
    }
}

/// What fit's replays start from: a fresh trace from nothing; a trace recorded mid-run from
/// the tensors live when recording began (PyTorch's cache then was its own product on a device
/// of another size, and no sequence of operations rebuilds it on the GPU check); a trace whose
/// start could not be rebuilt from nothing.
pub fn fit_start(trace: &Trace) -> (StartMode, &'static str) {
    match &trace.start {
        Ok(s) if s.is_fresh() => (StartMode::Exact, "fresh"),
        Ok(_) => (StartMode::LiveTensors, "live_tensors"),
        Err(_) => (StartMode::Empty, "empty"),
    }
}

fn verdict(
    trace: &Trace,
    problem: &Problem,
    search: &Search,
    origins: &[Origin],
    total: u64,
    reserve: &Reserve,
    fraction: Option<f64>,
) -> Result<Verdict, CliError> {
    let usable = usable_bytes(total, reserve.bytes, fraction);
    let at: Attempt = fit::attempt(problem, usable, false)
        .map_err(|e| CliError::run(format!("{}: {e}", trace.name())))?;
    let min_device = search
        .min_capacity
        .and_then(|c| min_device_bytes(c, reserve.bytes, fraction));
    let first_failure = at.first_failure.map(|op| failure(trace, origins, op));
    Ok(Verdict {
        fits: at.fits,
        allocator_bytes: usable,
        peak_reserved_bytes: at.peak_reserved_bytes,
        headroom_bytes: at
            .fits
            .then(|| usable.saturating_sub(at.peak_reserved_bytes)),
        spare_device_bytes: at
            .fits
            .then(|| min_device.map(|m| total.saturating_sub(m)))
            .flatten(),
        ooms: at.ooms,
        start_failed: at.start_failed,
        first_failure,
    })
}

fn failure(trace: &Trace, origins: &[Origin], op: usize) -> Failure {
    let (id, size, stream) = match trace.program.ops.get(op) {
        Some(&ReplayOp::Alloc { id, size, stream }) => (id, size, stream),
        _ => (usize::MAX, 0, 0),
    };
    let origin = origins.get(id).copied();
    let stack = origin.map_or(cachalot_tools::snapshot::StackId::EMPTY, |o| o.stack);
    let before = origin.is_some_and(|o| o.entry.is_none());
    Failure {
        op,
        trace_entry: origin.and_then(|o| o.entry),
        size,
        stream,
        label: summarize(&trace.snapshot.frames, stack, before).label,
        frames: frame_lines(&trace.snapshot.frames, stack),
    }
}

fn human_report(r: &FitReport, trace: &Trace) -> String {
    let mut s = String::new();
    let mut line = |l: String| {
        s.push_str(l.trim_end());
        s.push('\n');
    };
    line(format!("trace      {} (device {})", r.trace, r.device));
    line(format!("           {} operations", grouped(r.ops as u64)));
    line(format!(
        "start      {}",
        match r.start {
            "fresh" => "nothing held when recording began".to_string(),
            "live_tensors" => {
                let st = trace.start.as_ref().ok();
                format!(
                    "recording began mid-run: replayed from the {} tensors ({}) live then, placed by each policy",
                    grouped(st.map_or(0, |s| s.live_blocks().count()) as u64),
                    human(st.map_or(0, |s| s.live_requested_bytes()))
                )
            }
            _ => "UNKNOWN (the state when recording began could not be rebuilt): replayed from nothing; the figures miss what the process held then".to_string(),
        }
    ));
    line(format!(
        "reserve    {} outside the allocator (CUDA context and libraries): {}{}",
        human(r.reserve_bytes),
        r.reserve_source,
        if r.reserve_provisional {
            " — PROVISIONAL"
        } else {
            ""
        }
    ));
    if let Some(f) = r.memory_fraction {
        line(format!(
            "fraction   {f} (the allocator may reserve at most {f} of the device)"
        ));
    }
    line(format!(
        "search     {}; bisection in 2 MiB steps, every probe a full replay through the allocator's out-of-memory retry",
        match r.limit {
            Limit::Device => "the allocator's capacity on a card".to_string(),
            Limit::Fraction { total } => format!(
                "a memory fraction of a {} device (set_per_process_memory_fraction)",
                human(total)
            ),
        }
    ));
    line(String::new());
    line(format!(
        "{:<28}{:>16}{:>18}{:>20}{:>9}",
        "policy", "smallest device", "allocator needs", "peak (no limit)", "replays"
    ));
    let opt = |v: Option<u64>| v.map_or("none fits".to_string(), human);
    for p in &r.policies {
        line(format!(
            "{:<28}{:>16}{:>18}{:>20}{:>9}",
            p.name,
            opt(p.min_device_bytes),
            opt(p.min_allocator_bytes),
            human(p.unconstrained_peak_reserved_bytes),
            p.replays
        ));
        if let Some(f) = p.fraction {
            line(format!(
                "{:<28}memory fraction {f} of {} caps it there",
                "",
                human(p.fraction_device_bytes.unwrap_or(0))
            ));
        }
    }
    line(String::new());
    for p in &r.policies {
        line(format!("{:<12} {}", p.name, p.label));
    }
    if let Some(total) = r.device_memory_bytes
        && r.policies.iter().any(|p| p.verdict.is_some())
    {
        line(String::new());
        line(format!("verdict on a {} device:", human(total)));
        for p in &r.policies {
            let Some(v) = &p.verdict else { continue };
            if v.fits {
                line(format!(
                    "  {:<11} FITS: the allocator may use {}, peaks at {}: headroom {}{}",
                    p.name,
                    human(v.allocator_bytes),
                    human(v.peak_reserved_bytes),
                    human(v.headroom_bytes.unwrap_or(0)),
                    v.spare_device_bytes
                        .map(|d| format!(" (a device {} smaller would do)", human(d)))
                        .unwrap_or_default()
                ));
            } else {
                line(format!(
                    "  {:<11} DOES NOT FIT: the allocator may use {}; {} allocations fail",
                    p.name,
                    human(v.allocator_bytes),
                    grouped(v.ooms)
                ));
                if v.start_failed {
                    line(format!(
                        "{:<14}the tensors live when recording began do not all fit",
                        ""
                    ));
                }
                if let Some(f) = &v.first_failure {
                    line(format!(
                        "{:<14}the first: operation {}{}, {} ({} B) on stream {}, allocated at",
                        "",
                        grouped(f.op as u64),
                        f.trace_entry
                            .map(|e| format!(" (trace entry {})", grouped(e as u64)))
                            .unwrap_or_default(),
                        human(f.size),
                        grouped(f.size),
                        f.stream
                    ));
                    line(format!("{:<16}{}", "", f.label));
                    let python: Vec<&String> =
                        f.frames.iter().filter(|l| l.contains(".py:")).collect();
                    for l in python.iter().take(12) {
                        line(format!("{:<18}{l}", ""));
                    }
                    if python.len() > 12 {
                        line(format!(
                            "{:<18}… {} more Python frames",
                            "",
                            python.len() - 12
                        ));
                    }
                }
            }
        }
    }
    s.pop();
    s
}
