//! SVG plots: the memory timeline of one replay, and the one chart of grouped bars (`compare`'s
//! fragmentation, `bench-report`'s fragmentation and ns per operation).
//!
//! The one rule: peaks survive downsampling. A timeline is cut into at most [`MAX_POINTS`]
//! buckets of consecutive operations and each bucket keeps each series' maximum, so the
//! plotted peak is the true peak.

use std::ops::Range;
use std::path::Path;

use cachalot_tools::replay::Sample;
use plotters::coord::ranged1d::{AsRangedCoord, ValueFormatter};
use plotters::prelude::*;

use super::error::CliError;

/// Most points per timeline series.
pub const MAX_POINTS: usize = 3000;

const GIB: f64 = (1u64 << 30) as f64;

/// `timeline` cut into at most `max` buckets, each `(first operation index, the maximum of
/// each series over the bucket)`.
pub fn downsample(timeline: &[Sample], max: usize) -> Vec<(usize, Sample)> {
    let max = max.max(1);
    let per = timeline.len().div_ceil(max).max(1);
    timeline
        .chunks(per)
        .enumerate()
        .map(|(i, chunk)| {
            let top = chunk.iter().fold(
                Sample {
                    requested: 0,
                    allocated: 0,
                    reserved: 0,
                },
                |a, s| Sample {
                    requested: a.requested.max(s.requested),
                    allocated: a.allocated.max(s.allocated),
                    reserved: a.reserved.max(s.reserved),
                },
            );
            (i * per, top)
        })
        .collect()
}

fn failed(path: &Path, e: impl std::fmt::Display) -> CliError {
    CliError::run(format!("{}: cannot draw the plot: {e}", path.display()))
}

/// A memory timeline's chart: `x_desc` from 0 to `x_max`, GiB from 0 to a little above `top`.
pub type TimelineChart<'a, 'b> = ChartContext<
    'a,
    SVGBackend<'b>,
    Cartesian2d<plotters::coord::types::RangedCoordusize, plotters::coord::types::RangedCoordf64>,
>;

/// Sets up a memory timeline on `root` (1100 × 520): caption, axes, mesh.
pub fn timeline_chart<'a, 'b>(
    root: &'a DrawingArea<SVGBackend<'b>, plotters::coord::Shift>,
    path: &Path,
    title: &str,
    x_desc: &str,
    x_max: usize,
    top: f64,
) -> Result<TimelineChart<'a, 'b>, CliError> {
    root.fill(&WHITE).map_err(|e| failed(path, e))?;
    let mut chart = ChartBuilder::on(root)
        .caption(title, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(0..x_max.max(1), 0.0..(top * 1.08).max(1e-6))
        .map_err(|e| failed(path, e))?;
    chart
        .configure_mesh()
        .x_desc(x_desc)
        .y_desc("GiB")
        .y_label_formatter(&|y| format!("{y:.2}"))
        .light_line_style(WHITE.mix(0.0))
        .draw()
        .map_err(|e| failed(path, e))?;
    Ok(chart)
}

/// Writes each group's name under it (`at`: the group's centre on the x axis, in pixels), on
/// two staggered rows so that long names do not collide.
pub fn group_names(
    root: &DrawingArea<SVGBackend<'_>, plotters::coord::Shift>,
    path: &Path,
    names: &[String],
    at: impl Fn(usize) -> (i32, i32),
) -> Result<(), CliError> {
    for (t, name) in names.iter().enumerate() {
        let (x, y) = at(t);
        let row = if t % 2 == 0 { 8 } else { 26 };
        let style = TextStyle::from(("sans-serif", 13).into_font()).pos(
            plotters::style::text_anchor::Pos::new(
                plotters::style::text_anchor::HPos::Center,
                plotters::style::text_anchor::VPos::Top,
            ),
        );
        root.draw(&Text::new(name.clone(), (x, y + row), style))
            .map_err(|e| failed(path, e))?;
    }
    Ok(())
}

/// Draws requested, allocated and reserved bytes against operation index.
pub fn timeline(path: &Path, timeline: &[Sample], title: &str) -> Result<(), CliError> {
    let points = downsample(timeline, MAX_POINTS);
    let top = points
        .iter()
        .map(|(_, s)| s.reserved.max(s.allocated).max(s.requested))
        .max()
        .unwrap_or(0) as f64
        / GIB;
    let root = SVGBackend::new(path, (1100, 520)).into_drawing_area();
    let mut chart = timeline_chart(&root, path, title, "operation", timeline.len(), top)?;
    type Series = (&'static str, RGBColor, fn(&Sample) -> u64);
    let series: [Series; 3] = [
        ("reserved", RGBColor(214, 39, 40), |s| s.reserved),
        ("allocated", RGBColor(31, 119, 180), |s| s.allocated),
        ("requested", RGBColor(44, 160, 44), |s| s.requested),
    ];
    for (label, color, get) in series {
        chart
            .draw_series(LineSeries::new(
                points.iter().map(|(i, s)| (*i, get(s) as f64 / GIB)),
                color.stroke_width(2),
            ))
            .map_err(|e| failed(path, e))?
            .label(label)
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
            });
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

/// The value axis of a bar chart: bars rise from its start.
pub enum Axis {
    /// Linear.
    Linear(Range<f64>),
    /// Logarithmic.
    Log(Range<f64>),
}

/// One series of a bar chart: its legend label, its colour, its value in each group (`None`:
/// no bar there).
pub struct BarSeries {
    /// The legend's label.
    pub label: String,
    /// The bars' colour.
    pub color: RGBAColor,
    /// One value per group.
    pub values: Vec<Option<f64>>,
}

/// A chart of grouped bars: one group per name under the x axis, one bar per series in each.
pub struct Bars<'a> {
    /// The caption.
    pub title: &'a str,
    /// The groups' names.
    pub groups: &'a [String],
    /// The series, in legend order.
    pub series: Vec<BarSeries>,
    /// The value axis.
    pub axis: Axis,
    /// The value axis's name.
    pub y_desc: &'a str,
    /// Decimals of the value axis's labels.
    pub y_decimals: usize,
    /// The chart's width is 160 pixels a group, within these bounds.
    pub width: (u32, u32),
    /// Pixels left of the value axis for its labels.
    pub y_label_area: u32,
    /// The share of a group's slot its bars take.
    pub group_width: f64,
    /// The share of a bar's slot the bar fills.
    pub bar_fill: f64,
}

/// Draws a chart of grouped bars (SVG, 560 pixels high).
pub fn bars(path: &Path, b: &Bars<'_>) -> Result<(), CliError> {
    match &b.axis {
        Axis::Linear(range) => draw_bars(path, b, range.start, range.clone()),
        Axis::Log(range) => draw_bars(path, b, range.start, range.clone().log_scale()),
    }
}

fn draw_bars<Y>(path: &Path, b: &Bars<'_>, base: f64, y: Y) -> Result<(), CliError>
where
    Y: AsRangedCoord<Value = f64>,
    Y::CoordDescType: ValueFormatter<f64>,
{
    let n = b.groups.len().max(1);
    let k = b.series.len().max(1);
    let width = (160 * n as u32).clamp(b.width.0, b.width.1);
    let root = SVGBackend::new(path, (width, 560)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| failed(path, e))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(b.title, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(50)
        .y_label_area_size(b.y_label_area)
        .build_cartesian_2d(0.0..n as f64, y)
        .map_err(|e| failed(path, e))?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(0)
        .y_desc(b.y_desc)
        .y_label_formatter(&|y| format!("{y:.*}", b.y_decimals))
        .draw()
        .map_err(|e| failed(path, e))?;
    let bar = b.group_width / k as f64;
    for (c, series) in b.series.iter().enumerate() {
        let color = series.color;
        let rects = series.values.iter().enumerate().filter_map(|(t, v)| {
            let v = (*v)?;
            let x0 = t as f64 + (1.0 - b.group_width) / 2.0 + c as f64 * bar;
            Some(Rectangle::new(
                [(x0, base), (x0 + bar * b.bar_fill, v)],
                color.filled(),
            ))
        });
        chart
            .draw_series(rects)
            .map_err(|e| failed(path, e))?
            .label(series.label.as_str())
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], color.filled()));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(|e| failed(path, e))?;
    group_names(&root, path, b.groups, |t| {
        chart.backend_coord(&(t as f64 + 0.5, base))
    })?;
    root.present().map_err(|e| failed(path, e))
}

/// Grouped bars of fragmentation: for each trace (`names`), one bar per configuration
/// (`labels`) of `values[trace][config]`, from 1.0 (the physical limit) up.
pub fn fragmentation_bars(
    path: &Path,
    title: &str,
    names: &[String],
    labels: &[String],
    values: &[Vec<f64>],
) -> Result<(), CliError> {
    let top = values
        .iter()
        .flatten()
        .copied()
        .filter(|v| v.is_finite())
        .fold(1.0f64, f64::max);
    let series = labels
        .iter()
        .enumerate()
        .map(|(c, label)| BarSeries {
            label: label.clone(),
            color: Palette99::pick(c).to_rgba(),
            values: values
                .iter()
                .map(|row| row.get(c).copied().filter(|v| v.is_finite()))
                .collect(),
        })
        .collect();
    bars(
        path,
        &Bars {
            title,
            groups: names,
            series,
            axis: Axis::Linear(1.0..(1.0 + (top - 1.0) * 1.15).max(1.05)),
            y_desc: "fragmentation",
            y_decimals: 2,
            width: (700, 2000),
            y_label_area: 60,
            group_width: 0.8,
            bar_fill: 0.92,
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(requested: u64, allocated: u64, reserved: u64) -> Sample {
        Sample {
            requested,
            allocated,
            reserved,
        }
    }

    #[test]
    fn downsampling_keeps_every_peak() {
        let mut t: Vec<Sample> = (0..10_000).map(|i| s(i % 7, i % 11, i % 13)).collect();
        t[4321] = s(1000, 2000, 3000);
        let d = downsample(&t, 100);
        assert!(d.len() <= 100);
        let max = |f: fn(&Sample) -> u64| d.iter().map(|(_, x)| f(x)).max().unwrap();
        assert_eq!(max(|x| x.requested), 1000);
        assert_eq!(max(|x| x.allocated), 2000);
        assert_eq!(max(|x| x.reserved), 3000);
        assert_eq!(downsample(&t[..50], 100).len(), 50);
        assert!(downsample(&[], 100).is_empty());
    }
}
