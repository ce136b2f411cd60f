//! SVG plots of a `bench routing` run (`--out DIR`): throughput per mode against concurrency
//! for each policy, and the Markov model's prediction against the measured throughput; and
//! of a `bench quality` run: accuracy against the LLM's token share; and of a `bench load`
//! soak: the server's memory, descriptors, KV and latency over time.

use super::quality::QualityRow;
use super::routing::RoutingBenchRow;
use super::soak::Sample;
use plotters::coord::types::RangedCoordf64;
use plotters::prelude::*;
use std::path::{Path, PathBuf};

const SIZE: (u32, u32) = (720, 480);

type PlotResult<T> = Result<T, Box<dyn std::error::Error>>;

type Chart<'a, 'b> = ChartContext<'a, SVGBackend<'b>, Cartesian2d<RangedCoordf64, RangedCoordf64>>;

/// A labelled line through `points` with a dot on each, in the `k`-th palette colour.
fn labelled_line(
    chart: &mut Chart,
    points: Vec<(f64, f64)>,
    k: usize,
    label: &str,
) -> PlotResult<()> {
    let color = Palette99::pick(k).to_rgba();
    chart
        .draw_series(LineSeries::new(points.clone(), color.stroke_width(2)))?
        .label(label)
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], color.stroke_width(2)));
    chart.draw_series(
        points
            .into_iter()
            .map(|p| Circle::new(p, 4, color.filled())),
    )?;
    Ok(())
}

/// The series' labels in a framed, half-transparent box.
fn legend<'a, 'b>(chart: &mut Chart<'a, 'b>, position: SeriesLabelPosition) -> PlotResult<()>
where
    'b: 'a,
{
    chart
        .configure_series_labels()
        .position(position)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()?;
    Ok(())
}

/// Writes every plot into `dir` and returns their paths.
pub fn write_all(rows: &[RoutingBenchRow], dir: &Path) -> PlotResult<Vec<PathBuf>> {
    std::fs::create_dir_all(dir)?;
    let mut written = Vec::new();
    let mut policies: Vec<&str> = rows.iter().map(|r| r.policy.as_str()).collect();
    policies.dedup();
    for policy in policies {
        let path = dir.join(format!(
            "throughput-{}.svg",
            policy.replace(['/', '@'], "_")
        ));
        throughput(rows, policy, &path)?;
        written.push(path);
    }
    let path = dir.join("predicted-vs-measured.svg");
    if predicted_vs_measured(rows, &path)? {
        written.push(path);
    }
    Ok(written)
}

/// Mean tokens/s over rounds per (mode, concurrency), one line per mode.
fn throughput(rows: &[RoutingBenchRow], policy: &str, path: &Path) -> PlotResult<()> {
    let rows: Vec<&RoutingBenchRow> = rows.iter().filter(|r| r.policy == policy).collect();
    let mut modes: Vec<&str> = rows.iter().map(|r| r.mode).collect();
    modes.sort();
    modes.dedup();
    let max_n = rows.iter().map(|r| r.concurrency).max().unwrap_or(1) as f64;
    let max_y = rows.iter().map(|r| r.tokens_per_s).fold(1.0, f64::max) * 1.15;
    let root = SVGBackend::new(path, SIZE).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            format!("{policy}: throughput by execution mode"),
            ("sans-serif", 20),
        )
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(0.0..max_n + 1.0, 0.0..max_y)?;
    chart
        .configure_mesh()
        .x_desc("concurrent requests N")
        .y_desc("tokens/s")
        .draw()?;
    for (k, mode) in modes.iter().enumerate() {
        let mut points: Vec<(f64, f64)> = Vec::new();
        let mut ns: Vec<usize> = rows
            .iter()
            .filter(|r| r.mode == *mode)
            .map(|r| r.concurrency)
            .collect();
        ns.sort();
        ns.dedup();
        for n in ns {
            let cell: Vec<f64> = rows
                .iter()
                .filter(|r| r.mode == *mode && r.concurrency == n)
                .map(|r| r.tokens_per_s)
                .collect();
            points.push((n as f64, cell.iter().sum::<f64>() / cell.len() as f64));
        }
        labelled_line(&mut chart, points, k, mode)?;
    }
    legend(&mut chart, SeriesLabelPosition::MiddleRight)?;
    root.present()?;
    Ok(())
}

/// One point per cell with a prediction, measured while all N requests were in flight (the
/// system the model describes) where the cell has that window; false when no cell has one.
fn predicted_vs_measured(rows: &[RoutingBenchRow], path: &Path) -> PlotResult<bool> {
    let points: Vec<(f64, f64)> = rows
        .iter()
        .filter_map(|r| {
            let measured = r.all_in_flight_tokens_per_s.unwrap_or(r.tokens_per_s);
            r.predicted_tokens_per_s.map(|p| (p, measured))
        })
        .collect();
    if points.is_empty() {
        return Ok(false);
    }
    let max = points.iter().map(|&(p, m)| p.max(m)).fold(1.0, f64::max) * 1.1;
    let root = SVGBackend::new(path, SIZE).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            "Markov model: predicted vs measured throughput",
            ("sans-serif", 20),
        )
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(0.0..max, 0.0..max)?;
    chart
        .configure_mesh()
        .x_desc("predicted tokens/s")
        .y_desc("measured tokens/s, all N in flight")
        .draw()?;
    chart.draw_series(LineSeries::new([(0.0, 0.0), (max, max)], BLACK.mix(0.4)))?;
    chart.draw_series(points.into_iter().map(|p| Circle::new(p, 4, BLUE.filled())))?;
    root.present()?;
    Ok(true)
}

/// `bench quality --out DIR`: accuracy against the reference model's token share, one line
/// per policy through its threshold variants (`name@value`), each model alone a point.
pub fn quality(rows: &[QualityRow], reference: &str, dir: &Path) -> PlotResult<PathBuf> {
    std::fs::create_dir_all(dir)?;
    let path = dir.join("accuracy-vs-share.svg");
    accuracy_vs_share(rows, reference, &path)?;
    Ok(path)
}

fn accuracy_vs_share(rows: &[QualityRow], reference: &str, path: &Path) -> PlotResult<()> {
    let root = SVGBackend::new(path, SIZE).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            "Answer accuracy against LLM token share",
            ("sans-serif", 20),
        )
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(0.0..100.0, 0.0..100.0)?;
    chart
        .configure_mesh()
        .x_desc(format!("{reference} token share (%)"))
        .y_desc("accuracy (%)")
        .draw()?;
    let mut families: Vec<&str> = rows
        .iter()
        .map(|r| r.served.split('@').next().unwrap_or(&r.served))
        .collect();
    families.sort();
    families.dedup();
    for (k, family) in families.iter().enumerate() {
        let mut points: Vec<(f64, f64)> = rows
            .iter()
            .filter(|r| r.served.split('@').next() == Some(family))
            .map(|r| (100.0 * r.reference_token_share, 100.0 * r.accuracy))
            .collect();
        points.sort_by(|a, b| a.0.total_cmp(&b.0));
        labelled_line(&mut chart, points, k, family)?;
    }
    legend(&mut chart, SeriesLabelPosition::LowerRight)?;
    root.present()?;
    Ok(())
}

/// `bench load --out DIR`: the samples over time, one panel each for memory and descriptors,
/// KV, and latency.
pub fn soak(samples: &[Sample], dir: &Path) -> PlotResult<PathBuf> {
    std::fs::create_dir_all(dir)?;
    let path = dir.join("soak.svg");
    draw_soak(samples, &path)?;
    Ok(path)
}

fn draw_soak(samples: &[Sample], path: &Path) -> PlotResult<()> {
    let root = SVGBackend::new(path, (720, 900)).into_drawing_area();
    root.fill(&WHITE)?;
    let panels = root.split_evenly((3, 1));
    let end = samples.last().map_or(1.0, |s| s.at_s.max(1.0));
    type Series = (&'static str, fn(&Sample) -> Option<f64>);
    let groups: [(&str, &str, Vec<Series>); 3] = [
        (
            "Server memory and open file descriptors",
            "MiB / descriptors",
            vec![
                ("RSS MiB", |s| s.rss_mib),
                ("open fds", |s| s.fds.map(|n| n as f64)),
            ],
        ),
        (
            "KV tokens (all models)",
            "tokens",
            vec![
                ("used by requests", |s| Some(s.kv_tokens_used)),
                ("cached", |s| Some(s.kv_tokens_cached)),
            ],
        ),
        (
            "Latency of the requests completed in each interval",
            "ms",
            vec![("p50", |s| s.latency_ms_p50), ("p99", |s| s.latency_ms_p99)],
        ),
    ];
    for (panel, (caption, unit, series)) in panels.iter().zip(groups) {
        let top = series
            .iter()
            .flat_map(|(_, pick)| samples.iter().filter_map(pick))
            .fold(1.0, f64::max);
        let mut chart = ChartBuilder::on(panel)
            .caption(caption, ("sans-serif", 18))
            .margin(10)
            .x_label_area_size(35)
            .y_label_area_size(60)
            .build_cartesian_2d(0.0..end, 0.0..top * 1.1)?;
        chart
            .configure_mesh()
            .x_desc("seconds")
            .y_desc(unit)
            .draw()?;
        for (k, (label, pick)) in series.iter().enumerate() {
            let points: Vec<(f64, f64)> = samples
                .iter()
                .filter_map(|s| pick(s).map(|v| (s.at_s, v)))
                .collect();
            labelled_line(&mut chart, points, k, label)?;
        }
        legend(&mut chart, SeriesLabelPosition::LowerRight)?;
    }
    root.present()?;
    Ok(())
}
