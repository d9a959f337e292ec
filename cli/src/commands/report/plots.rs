//! The report's pictures, as inline SVG strings drawn with plotters' SVG backend
//! (text as `<text>` elements laid out by plotters' built-in metrics, so no font
//! library and no external file is needed).

use anyhow::anyhow;
use plotters::prelude::*;
use plotters::style::colors::colormaps::ViridisRGB;

/// Width and height of a full-width chart, in pixels.
pub const WIDE: (u32, u32) = (960, 320);
/// Width and height of one chart of the per-layer small multiples.
pub const SMALL: (u32, u32) = (300, 200);

/// One named line of a chart.
pub struct Series {
    pub name: String,
    pub points: Vec<(f64, f64)>,
}

fn err(e: impl std::fmt::Display) -> anyhow::Error {
    anyhow!("cannot draw a chart: {e}")
}

/// The series' legend, in the upper right corner of every chart that has one.
fn legend<'a, CT: plotters::coord::CoordTranslate>(
    chart: &mut ChartContext<'a, SVGBackend<'a>, CT>,
) -> anyhow::Result<()> {
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK.mix(0.3))
        .label_font(("sans-serif", 11))
        .position(SeriesLabelPosition::UpperRight)
        .draw()
        .map_err(err)
}

/// The range of `values` with a margin, never empty.
fn range(values: impl Iterator<Item = f64>) -> (f64, f64) {
    let (lo, hi) = values
        .filter(|v| v.is_finite())
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| {
            (lo.min(v), hi.max(v))
        });
    if !lo.is_finite() {
        return (0.0, 1.0);
    }
    let pad = ((hi - lo) * 0.05).max(hi.abs() * 0.02).max(1e-9);
    (lo - pad, hi + pad)
}

/// The colour of series `i`.
pub fn color(i: usize) -> RGBColor {
    let c = Palette99::pick(i).to_rgba();
    RGBColor(c.0, c.1, c.2)
}

/// Lines over steps, with dashed vertical marks (detected jumps) at `marks`.
pub fn lines(
    title: &str,
    y_label: &str,
    series: &[Series],
    marks: &[f64],
    size: (u32, u32),
) -> anyhow::Result<String> {
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, size).into_drawing_area();
        root.fill(&WHITE).map_err(err)?;
        let xs = range(series.iter().flat_map(|s| s.points.iter().map(|p| p.0)));
        let ys = range(series.iter().flat_map(|s| s.points.iter().map(|p| p.1)));
        let small = size.0 < 500;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", if small { 13 } else { 16 }))
            .margin(8)
            .x_label_area_size(if small { 22 } else { 32 })
            .y_label_area_size(if small { 40 } else { 64 })
            .build_cartesian_2d(xs.0..xs.1, ys.0..ys.1)
            .map_err(err)?;
        chart
            .configure_mesh()
            .x_desc(if small { "" } else { "step" })
            .y_desc(y_label)
            .x_labels(if small { 4 } else { 10 })
            .y_labels(if small { 4 } else { 6 })
            .x_label_formatter(&|x| format!("{x:.0}"))
            .y_label_formatter(&|y| short(*y))
            .light_line_style(WHITE.mix(0.0))
            .draw()
            .map_err(err)?;
        for m in marks {
            chart
                .draw_series(DashedLineSeries::new(
                    [(*m, ys.0), (*m, ys.1)],
                    4,
                    3,
                    RED.stroke_width(1),
                ))
                .map_err(err)?;
        }
        for (i, s) in series.iter().enumerate() {
            let c = color(i);
            let drawn = chart
                .draw_series(LineSeries::new(s.points.iter().copied(), c.stroke_width(2)))
                .map_err(err)?;
            if series.len() > 1 {
                drawn
                    .label(s.name.clone())
                    .legend(move |(x, y)| PathElement::new([(x, y), (x + 14, y)], c));
            }
        }
        if series.len() > 1 && series.len() <= 16 {
            legend(&mut chart)?;
        }
        root.present().map_err(err)?;
    }
    Ok(svg)
}

/// A rank × step heatmap: one row per rank, `cells` values per row (None is
/// blank), coloured from low (dark) to high (yellow).
pub fn heatmap(
    title: &str,
    rows: &[(String, Vec<Option<f64>>)],
    first_step: f64,
    step_width: f64,
) -> anyhow::Result<String> {
    let mut svg = String::new();
    let cols = rows.iter().map(|r| r.1.len()).max().unwrap_or(0).max(1);
    let height = (80 + 14 * rows.len().max(1)).clamp(160, 900) as u32;
    {
        let root = SVGBackend::with_string(&mut svg, (WIDE.0, height)).into_drawing_area();
        root.fill(&WHITE).map_err(err)?;
        let (lo, hi) = range(rows.iter().flat_map(|r| r.1.iter().flatten().copied()));
        let x_end = first_step + step_width * cols as f64;
        let n = rows.len().max(1) as u32;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 16))
            .margin(8)
            .margin_right(90)
            .x_label_area_size(32)
            .y_label_area_size(64)
            .build_cartesian_2d(first_step..x_end, (0u32..n).into_segmented())
            .map_err(err)?;
        let labels: Vec<String> = rows.iter().map(|r| r.0.clone()).collect();
        chart
            .configure_mesh()
            .disable_mesh()
            .x_desc("step")
            .y_desc("rank")
            .y_labels(rows.len().clamp(1, 64))
            .x_label_formatter(&|x| format!("{x:.0}"))
            .y_label_formatter(&|y| category(&labels, y))
            .draw()
            .map_err(err)?;
        for (r, (_, cells)) in rows.iter().enumerate() {
            let r = r as u32;
            chart
                .draw_series(cells.iter().enumerate().filter_map(|(c, v)| {
                    let v = (*v)?;
                    let h = if hi > lo { (v - lo) / (hi - lo) } else { 0.5 };
                    let x0 = first_step + step_width * c as f64;
                    Some(Rectangle::new(
                        [
                            (x0, SegmentValue::Exact(r)),
                            (x0 + step_width, SegmentValue::Exact(r + 1)),
                        ],
                        ViridisRGB.get_color(h as f32).filled(),
                    ))
                }))
                .map_err(err)?;
        }
        // The colour scale, on the right.
        let scale = root.margin(40, 40, (WIDE.0 - 70) as i32, 8);
        let bands: i32 = 20;
        for i in 0..bands {
            let h = f64::from(i) / f64::from(bands - 1);
            let band = (scale.dim_in_pixel().1 as i32 - 20) / bands;
            let y = 10 + band * (bands - 1 - i);
            scale
                .draw(&Rectangle::new(
                    [(0, y), (14, y + band)],
                    ViridisRGB.get_color(h as f32).filled(),
                ))
                .map_err(err)?;
        }
        let style = ("sans-serif", 11).into_font();
        scale
            .draw_text(&format!("{} ms", short(hi)), &style.color(&BLACK), (0, 0))
            .map_err(err)?;
        let bottom = scale.dim_in_pixel().1 as i32 - 8;
        scale
            .draw_text(
                &format!("{} ms", short(lo)),
                &style.color(&BLACK),
                (0, bottom),
            )
            .map_err(err)?;
        root.present().map_err(err)?;
    }
    Ok(svg)
}

/// Horizontal stacked bars: one bar per category, one segment per part.
pub fn stacked_bars(
    title: &str,
    x_label: &str,
    categories: &[String],
    parts: &[(String, Vec<f64>)],
) -> anyhow::Result<String> {
    let mut svg = String::new();
    let height = (90 + 18 * categories.len().max(1)).clamp(160, 900) as u32;
    {
        let root = SVGBackend::with_string(&mut svg, (WIDE.0, height)).into_drawing_area();
        root.fill(&WHITE).map_err(err)?;
        let total = (0..categories.len())
            .map(|i| {
                parts
                    .iter()
                    .map(|p| p.1.get(i).copied().unwrap_or(0.0))
                    .sum::<f64>()
            })
            .fold(0.0, f64::max);
        let n = categories.len().max(1) as u32;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 16))
            .margin(8)
            .x_label_area_size(32)
            .y_label_area_size(64)
            .build_cartesian_2d(0f64..(total * 1.25).max(1e-9), (0u32..n).into_segmented())
            .map_err(err)?;
        chart
            .configure_mesh()
            .disable_y_mesh()
            .x_desc(x_label)
            .y_labels(categories.len().clamp(1, 64))
            .x_label_formatter(&|x| short(*x))
            .y_label_formatter(&|y| category(categories, y))
            .draw()
            .map_err(err)?;
        let mut start = vec![0.0; categories.len()];
        for (k, (name, values)) in parts.iter().enumerate() {
            let c = color(k);
            let bars: Vec<Rectangle<(f64, SegmentValue<u32>)>> = values
                .iter()
                .enumerate()
                .filter(|(_, v)| **v > 0.0)
                .map(|(i, v)| {
                    let r = Rectangle::new(
                        [
                            (start[i], SegmentValue::Exact(i as u32)),
                            (start[i] + v, SegmentValue::Exact(i as u32 + 1)),
                        ],
                        c.filled(),
                    );
                    start[i] += v;
                    r
                })
                .collect();
            chart
                .draw_series(bars)
                .map_err(err)?
                .label(name.clone())
                .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], c.filled()));
        }
        legend(&mut chart)?;
        root.present().map_err(err)?;
    }
    Ok(svg)
}

/// The label of a category axis' segment.
fn category(labels: &[String], v: &SegmentValue<u32>) -> String {
    match v {
        SegmentValue::CenterOf(i) => labels.get(*i as usize).cloned().unwrap_or_default(),
        _ => String::new(),
    }
}

/// A number in few characters: 1234567 → 1.23M, 0.00123 → 0.00123.
pub fn short(v: f64) -> String {
    let a = v.abs();
    if a >= 1e9 {
        format!("{:.2}G", v / 1e9)
    } else if a >= 1e6 {
        format!("{:.2}M", v / 1e6)
    } else if a >= 1e4 {
        format!("{:.1}k", v / 1e3)
    } else if a >= 100.0 {
        format!("{v:.0}")
    } else if a >= 1.0 {
        format!("{v:.2}")
    } else if a == 0.0 {
        "0".into()
    } else {
        format!("{v:.3}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn charts_are_svg_with_their_titles_even_when_empty() {
        let s = Series {
            name: "a".into(),
            points: vec![(0.0, 1.0), (10.0, 2.0)],
        };
        let svg = lines("loss", "loss", &[s], &[5.0], WIDE).unwrap();
        assert!(svg.starts_with("<svg") && svg.contains("\nloss\n"), "{svg}");
        let svg = lines("empty", "", &[], &[], SMALL).unwrap();
        assert!(svg.contains("<svg"));
        let svg = heatmap("t", &[("0".into(), vec![Some(1.0), None])], 0.0, 1.0).unwrap();
        assert!(svg.contains("<rect"));
        let svg = stacked_bars("p", "ms", &["0".into()], &[("data".into(), vec![1.0])]).unwrap();
        assert!(svg.contains("\ndata\n"), "{svg}");
    }

    #[test]
    fn numbers_are_short() {
        assert_eq!(short(1_234_567.0), "1.23M");
        assert_eq!(short(12.345), "12.35");
        assert_eq!(short(0.0), "0");
    }
}
