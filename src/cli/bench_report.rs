//! `cachalot bench-report DIR`: the side-by-side GPU benchmark's runs (`docs/GPU_BENCH.md`)
//! turned into `results.json`, `results.csv`, `results.md` and SVG plots — a memory timeline
//! per trace with every allocator on it, grouped bars of fragmentation and of ns/op, and the
//! hot loop's scaling.

use std::path::{Path, PathBuf};

use cachalot_tools::bench::report::{self, Results, WHOLE_TRACE, allocator_label};
use cachalot_tools::bench::tables;
use plotters::prelude::*;

use super::error::CliError;
use super::plot;

/// Arguments of `cachalot bench-report`.
#[derive(Debug, clap::Args)]
pub struct BenchReportArgs {
    /// The benchmark's output directory: `runs/*.json` and `machine.json`.
    pub dir: PathBuf,
    /// Where to write the report (default: DIR itself).
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,
}

/// Runs `cachalot bench-report`.
pub fn run(args: &BenchReportArgs) -> Result<(), CliError> {
    let results = report::load(&args.dir).map_err(|e| CliError::input(e.to_string()))?;
    let out = args.out.clone().unwrap_or_else(|| args.dir.clone());
    std::fs::create_dir_all(&out).map_err(|e| CliError::run(format!("{}: {e}", out.display())))?;
    let write = |name: &str, text: &str| {
        let path = out.join(name);
        std::fs::write(&path, text).map_err(|e| CliError::run(format!("{}: {e}", path.display())))
    };
    let json = serde_json::to_string_pretty(&tables::results_json(&results))
        .map_err(|e| CliError::run(e.to_string()))?;
    write("results.json", &(json + "\n"))?;
    write("results.csv", &tables::csv(&results))?;
    let mut md = tables::markdown(&results);
    md.push_str("\n## Plots\n\n");
    for name in plots(&results, &out)? {
        md.push_str(&format!("- [{name}]({name})\n"));
    }
    write("results.md", &md)?;
    println!("{}", md);
    println!("wrote {}", out.display());
    Ok(())
}

fn failed(path: &Path, e: impl std::fmt::Display) -> CliError {
    CliError::run(format!("{}: cannot draw the plot: {e}", path.display()))
}

/// The allocators' colours, one each, the same in every plot.
fn color(allocator: &str) -> RGBColor {
    match allocator {
        "pytorch" => RGBColor(228, 26, 28),
        "pytorch-expandable" => RGBColor(255, 127, 0),
        "cuda-pool" => RGBColor(152, 78, 163),
        "cumemalloc" => RGBColor(166, 86, 40),
        "cachalot-pytorch" => RGBColor(55, 126, 184),
        "cachalot-expandable" => RGBColor(77, 175, 74),
        "cachalot" => RGBColor(0, 0, 0),
        _ => RGBColor(128, 128, 128),
    }
}

/// Draws every plot; returns their file names.
fn plots(results: &Results, out: &Path) -> Result<Vec<String>, CliError> {
    let mut names = Vec::new();
    let traces = results.trace_names();
    let whole: Vec<String> = results
        .trace_allocators()
        .into_iter()
        .filter(|a| WHOLE_TRACE.contains(&a.as_str()))
        .collect();
    if !traces.is_empty() && !whole.is_empty() {
        let values: Vec<Vec<f64>> = traces
            .iter()
            .map(|t| {
                whole
                    .iter()
                    .map(|a| results.memory_ratio(t, a).unwrap_or(f64::NAN))
                    .collect()
            })
            .collect();
        let labels: Vec<String> = whole.iter().map(|a| allocator_label(a)).collect();
        let name = "fragmentation.svg".to_string();
        plot::fragmentation_bars(
            &out.join(&name),
            "memory: peak reserved / peak in use (live and held-back bytes)",
            &traces,
            &labels,
            &values,
        )?;
        names.push(name);
        let name = "ns_per_op.svg".to_string();
        let all = results.trace_allocators();
        ns_bars(results, &out.join(&name), &traces, &all)?;
        names.push(name);
    }
    if !results.hot.is_empty() {
        let name = "hot_loop.svg".to_string();
        hot_loop(results, &out.join(&name))?;
        names.push(name);
    }
    for trace in &traces {
        let name = format!("timeline_{trace}.svg");
        if timeline(results, trace, &out.join(&name))? {
            names.push(name);
        }
    }
    Ok(names)
}

/// Grouped bars of steady-state ns per operation line, on a log scale.
fn ns_bars(
    results: &Results,
    path: &Path,
    traces: &[String],
    allocators: &[String],
) -> Result<(), CliError> {
    let value = |t: &str, a: &str| {
        results
            .run(t, a)
            .and_then(|r| r.ns_per_op_steady.or(r.ns_per_op_first))
            .filter(|v| v.is_finite() && *v > 0.0)
    };
    let all: Vec<f64> = traces
        .iter()
        .flat_map(|t| allocators.iter().filter_map(move |a| value(t, a)))
        .collect();
    let (lo, hi) = all
        .iter()
        .fold((f64::MAX, 1.0f64), |(lo, hi), v| (lo.min(*v), hi.max(*v)));
    let lo = if lo == f64::MAX { 1.0 } else { lo / 2.0 };
    let series = allocators
        .iter()
        .map(|a| plot::BarSeries {
            label: allocator_label(a),
            color: color(a).to_rgba(),
            values: traces.iter().map(|t| value(t, a)).collect(),
        })
        .collect();
    plot::bars(
        path,
        &plot::Bars {
            title: "ns per operation, steady state (log scale; cuMemAlloc: first pass of a prefix)",
            groups: traces,
            series,
            axis: plot::Axis::Log(lo..hi * 2.0),
            y_desc: "ns per operation",
            y_decimals: 0,
            width: (800, 2400),
            y_label_area: 70,
            group_width: 0.85,
            bar_fill: 0.9,
        },
    )
}

/// Wall ns per pair against threads, one line per allocator and path, log scale.
fn hot_loop(results: &Results, path: &Path) -> Result<(), CliError> {
    /// One line: the allocator, the path, (threads, wall ns per pair) points.
    type Line = (String, String, Vec<(u64, f64)>);
    let points: Vec<Line> = results
        .hot
        .iter()
        .filter(|h| h.error.is_none())
        .map(|h| {
            let pts = h
                .threads
                .iter()
                .zip(&h.wall_ns_per_pair)
                .filter(|(_, v)| v.is_finite() && **v > 0.0)
                .map(|(t, v)| (*t, *v))
                .collect();
            (h.allocator.clone(), h.path.clone(), pts)
        })
        .collect();
    let all = points.iter().flat_map(|p| p.2.iter().map(|x| x.1));
    let (lo, hi) = all.fold((f64::MAX, 1.0f64), |(lo, hi), v| (lo.min(v), hi.max(v)));
    let lo = if lo == f64::MAX { 1.0 } else { lo / 2.0 };
    let tmax = points
        .iter()
        .flat_map(|p| p.2.iter().map(|x| x.0))
        .max()
        .unwrap_or(8)
        .max(2);
    let root = SVGBackend::new(path, (900, 560)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| failed(path, e))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            "hot alloc+free pairs: wall ns per pair over all threads (log scale)",
            ("sans-serif", 20),
        )
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(1u64..tmax, (lo..hi * 2.0).log_scale())
        .map_err(|e| failed(path, e))?;
    chart
        .configure_mesh()
        .x_desc("threads")
        .y_desc("wall ns per pair")
        .y_label_formatter(&|y| format!("{y:.0}"))
        .draw()
        .map_err(|e| failed(path, e))?;
    for (allocator, via, pts) in points {
        let col = color(&allocator);
        let style = if via == "buffer" {
            col.stroke_width(1)
        } else {
            col.stroke_width(2)
        };
        chart
            .draw_series(LineSeries::new(pts.iter().copied(), style))
            .map_err(|e| failed(path, e))?
            .label(format!("{} ({via})", allocator_label(&allocator)))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], style));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(|e| failed(path, e))?;
    root.present().map_err(|e| failed(path, e))
}

/// Reserved bytes against operation line for every allocator that has a timeline of `trace`,
/// and the requested bytes; false when none has one.
fn timeline(results: &Results, trace: &str, path: &Path) -> Result<bool, CliError> {
    const GIB: f64 = (1u64 << 30) as f64;
    let runs: Vec<_> = results
        .traces
        .iter()
        .filter(|r| r.trace == trace && r.error.is_none())
        .filter_map(|r| r.timeline.as_ref().map(|t| (r, t)))
        .filter(|(_, t)| !t.line.is_empty())
        .collect();
    if runs.is_empty() {
        return Ok(false);
    }
    let x_max = runs
        .iter()
        .map(|(r, t)| r.lines.max(t.line.last().copied().unwrap_or(0) + 1))
        .max()
        .unwrap_or(1)
        .max(1);
    let top = runs
        .iter()
        .flat_map(|(_, t)| t.reserved.iter().chain(&t.requested))
        .copied()
        .max()
        .unwrap_or(0) as f64
        / GIB;
    let root = SVGBackend::new(path, (1100, 520)).into_drawing_area();
    let title = format!("{trace}: reserved memory per allocator");
    let mut chart =
        plot::timeline_chart(&root, path, &title, "operation line", x_max as usize, top)?;
    // The requested bytes once (the longest run's: the others are the same or a prefix).
    if let Some((_, t)) = runs.iter().max_by_key(|(r, _)| r.lines) {
        let grey = RGBColor(150, 150, 150);
        chart
            .draw_series(LineSeries::new(
                t.line
                    .iter()
                    .zip(&t.requested)
                    .map(|(x, y)| (*x as usize, *y as f64 / GIB)),
                grey.stroke_width(3),
            ))
            .map_err(|e| failed(path, e))?
            .label("requested (live tensors)")
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], grey.stroke_width(3))
            });
    }
    for (r, t) in &runs {
        let col = color(&r.allocator);
        let label = match r.allocator.as_str() {
            "cumemalloc" => format!("{} (prefix)", allocator_label(&r.allocator)),
            a => allocator_label(a),
        };
        chart
            .draw_series(LineSeries::new(
                t.line
                    .iter()
                    .zip(&t.reserved)
                    .map(|(x, y)| (*x as usize, *y as f64 / GIB)),
                col.stroke_width(2),
            ))
            .map_err(|e| failed(path, e))?
            .label(label)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], col.stroke_width(2)));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(|e| failed(path, e))?;
    root.present().map_err(|e| failed(path, e))?;
    Ok(true)
}
