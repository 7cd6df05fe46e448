//! The one-line advice `cachalot explain` gives, each line backed by a replay it runs.
//!
//! The one rule: a line says what a change would do only after replaying the program with that
//! change, and it gives both peaks; what no replay can back (the floor the live tensors set) is
//! said as a figure of the breakdown, not as a prediction.

use cachalot::Settings;
use serde::Serialize;

use crate::replay::engine::{ReplayConfig, ReplayError, replay};
use crate::replay::program::{ReplayOp, ReplayProgram};
use crate::replay::start::StartMode;
use crate::units::human;

use super::moment::Breakdown;

/// The `max_split_size_mb` values tried.
pub const MAX_SPLIT_CANDIDATES_MB: [u64; 4] = [64, 128, 256, 512];

/// A change smaller than this is "no change" (one small segment).
const NOISE: u64 = 2 << 20;

/// One line of advice.
#[derive(Clone, Debug, Serialize)]
pub struct Advice {
    /// What it is about: `expandable_segments`, `max_split_size_mb`, `empty_cache`,
    /// `live_tensors`.
    pub kind: &'static str,
    /// The line.
    pub text: String,
    /// Peak reserved bytes of the replay the line compares against (the explained settings).
    pub baseline_peak_bytes: u64,
    /// Peak reserved bytes of the replay with the change; `None` for a line no replay backs.
    pub peak_bytes: Option<u64>,
    /// The settings (or the program change) replayed.
    pub tried: String,
}

/// What the advice replays start from and how.
#[derive(Clone, Debug)]
pub struct AdviceSetup<'a> {
    /// The program.
    pub program: &'a ReplayProgram,
    /// The explained settings.
    pub settings: &'a Settings,
    /// The simulated device.
    pub capacity: u64,
    /// The start of every advice replay, the baseline's included: for a trace recorded
    /// mid-run the tensors live then ([`StartMode::LiveTensors`]), since PyTorch's cached
    /// layout belongs to the recorded settings alone.
    pub start: StartMode,
}

impl AdviceSetup<'_> {
    fn peak(&self, settings: &Settings, program: &ReplayProgram) -> Result<u64, ReplayError> {
        let config = ReplayConfig {
            settings: settings.clone(),
            capacity: self.capacity,
            start: self.start,
            ..ReplayConfig::pytorch()
        };
        Ok(replay(program, &config)?.peak_reserved_bytes)
    }
}

fn change(base: u64, alt: u64) -> String {
    if alt < base {
        format!("{} → {}, −{}", human(base), human(alt), human(base - alt))
    } else {
        format!("{} → {}, +{}", human(base), human(alt), human(alt - base))
    }
}

/// The advice for the moment `b` of the replay `setup` describes (see the module's rule).
pub fn advise(setup: &AdviceSetup, b: &Breakdown) -> Result<Vec<Advice>, ReplayError> {
    let program = setup.program;
    let settings = setup.settings;
    let base = setup.peak(settings, program)?;
    let mut out = Vec::new();

    // Expandable segments, switched the other way.
    let mut toggled = settings.clone();
    toggled.expandable_segments = !settings.expandable_segments;
    let alt = setup.peak(&toggled, program)?;
    let text = match (settings.expandable_segments, alt.abs_diff(base) < NOISE) {
        (false, true) => format!(
            "expandable segments would change nothing here (peak reserved {})",
            change(base, alt)
        ),
        (false, false) if alt < base => format!(
            "expandable segments would save {} (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True; peak reserved {})",
            human(base - alt),
            change(base, alt)
        ),
        (false, false) => format!(
            "expandable segments would not help here: they would cost {} more (peak reserved {})",
            human(alt - base),
            change(base, alt)
        ),
        (true, true) => format!(
            "expandable segments change nothing here (without them: peak reserved {})",
            change(base, alt)
        ),
        (true, false) if alt > base => format!(
            "expandable segments save {} here: keep them (without them: peak reserved {})",
            human(alt - base),
            change(base, alt)
        ),
        (true, false) => format!(
            "expandable segments cost {} here: without them the peak reserved goes {}",
            human(base - alt),
            change(base, alt)
        ),
    };
    out.push(Advice {
        kind: "expandable_segments",
        text,
        baseline_peak_bytes: base,
        peak_bytes: Some(alt),
        tried: format!("expandable_segments:{}", toggled.expandable_segments),
    });

    // max_split_size_mb: the usual candidates, and none when one is set.
    let mut tried: Vec<(String, u64)> = Vec::new();
    for mb in MAX_SPLIT_CANDIDATES_MB {
        let mut s = settings.clone();
        if s.max_split_size == mb << 20 {
            continue;
        }
        s.max_split_size = mb << 20;
        tried.push((format!("max_split_size_mb:{mb}"), setup.peak(&s, program)?));
    }
    if settings.max_split_size != u64::MAX {
        let mut s = settings.clone();
        s.max_split_size = u64::MAX;
        tried.push(("no max_split_size_mb".to_string(), setup.peak(&s, program)?));
    }
    if let Some((best_name, best)) = tried.iter().min_by_key(|(_, p)| *p).cloned() {
        let all = tried
            .iter()
            .map(|(n, p)| {
                format!(
                    "{}: {}",
                    n.trim_start_matches("max_split_size_mb:"),
                    human(*p)
                )
            })
            .collect::<Vec<_>>()
            .join(", ");
        let text = if best + NOISE <= base {
            format!(
                "{best_name} would save {} (peak reserved {}; tried {all})",
                human(base - best),
                change(base, best)
            )
        } else {
            format!(
                "max_split_size_mb would not help here: peak reserved {} now, {all}",
                human(base)
            )
        };
        out.push(Advice {
            kind: "max_split_size_mb",
            text,
            baseline_peak_bytes: base,
            peak_bytes: Some(best),
            tried: best_name,
        });
    }

    // empty_cache() right before the operation that made the moment.
    if let Some(op) = b.op
        && b.releasable_bytes > 0
    {
        let with = with_empty_cache_before(program, op);
        let alt = setup.peak(settings, &with)?;
        let text = if alt + NOISE <= base {
            format!(
                "torch.cuda.empty_cache() right before operation {op} (where {} sits in wholly free segments) would lower the peak by {} (peak reserved {})",
                human(b.releasable_bytes),
                human(base - alt),
                change(base, alt)
            )
        } else {
            format!(
                "torch.cuda.empty_cache() right before operation {op} (where {} sits in wholly free segments) would not lower the peak (peak reserved {}): what it gives back is taken again",
                human(b.releasable_bytes),
                change(base, alt)
            )
        };
        out.push(Advice {
            kind: "empty_cache",
            text,
            baseline_peak_bytes: base,
            peak_bytes: Some(alt),
            tried: format!("empty_cache() before operation {op}"),
        });
    }

    // The floor: what the live tensors hold.
    if b.reserved_bytes > 0 {
        let share = b.live_bytes as f64 / b.reserved_bytes as f64 * 100.0;
        let largest = b
            .groups
            .first()
            .map(|g| format!("; the largest group holds {}: {}", human(g.bytes), g.label))
            .unwrap_or_default();
        out.push(Advice {
            kind: "live_tensors",
            text: format!(
                "the live tensors hold {} of the {} reserved here ({share:.1}%): no allocator setting goes below that at this moment, only holding fewer or smaller tensors does{largest}",
                human(b.live_bytes),
                human(b.reserved_bytes)
            ),
            baseline_peak_bytes: base,
            peak_bytes: None,
            tried: String::new(),
        });
    }
    Ok(out)
}

/// `program` with an `empty_cache()` inserted before operation `op` (the segment addresses of
/// later operations shifted with them).
pub fn with_empty_cache_before(program: &ReplayProgram, op: usize) -> ReplayProgram {
    let mut p = program.clone();
    let at = op.min(p.ops.len());
    p.ops.insert(at, ReplayOp::EmptyCache);
    if at <= p.op_entries.len() && !p.op_entries.is_empty() {
        let entry = p
            .op_entries
            .get(at)
            .or(p.op_entries.last())
            .copied()
            .unwrap_or(0);
        p.op_entries.insert(at, entry);
    }
    for (i, _) in p.segment_at.iter_mut() {
        if *i >= at {
            *i += 1;
        }
    }
    p
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_inserted_empty_cache_shifts_later_segment_addresses() {
        let program = ReplayProgram {
            ops: vec![
                ReplayOp::Alloc {
                    id: 0,
                    size: 1,
                    stream: 0,
                },
                ReplayOp::Alloc {
                    id: 1,
                    size: 1,
                    stream: 0,
                },
            ],
            segment_at: vec![(0, 0x1000), (1, 0x2000)],
            ..ReplayProgram::default()
        };
        let p = with_empty_cache_before(&program, 1);
        assert_eq!(p.ops[1], ReplayOp::EmptyCache);
        assert_eq!(p.segment_at, vec![(0, 0x1000), (2, 0x2000)]);
    }
}
