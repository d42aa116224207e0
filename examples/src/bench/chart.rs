//! Charts of benchmark results as SVG (plotters): grouped bars, one group per category (a
//! scenario, a routing setup), one bar per series (a concurrency level, a quantile).

use plotters::prelude::*;

/// One series: its name and a value per category.
pub struct Series {
    /// The legend's text.
    pub name: String,
    /// One value per category, in order.
    pub values: Vec<f64>,
}

impl Series {
    /// The series `name` of `value` read from each of `rows` (one row per category).
    pub fn of<R>(name: &str, rows: &[R], value: impl Fn(&R) -> f64) -> Self {
        Series {
            name: name.to_owned(),
            values: rows.iter().map(value).collect(),
        }
    }
}

const PALETTE: [RGBColor; 6] = [
    RGBColor(0x1f, 0x77, 0xb4),
    RGBColor(0xff, 0x7f, 0x0e),
    RGBColor(0x2c, 0xa0, 0x2c),
    RGBColor(0xd6, 0x27, 0x28),
    RGBColor(0x94, 0x67, 0xbd),
    RGBColor(0x8c, 0x56, 0x4b),
];

/// A grouped bar chart titled `title` with `y_desc` on the y axis.
pub fn grouped_bars(
    title: &str,
    y_desc: &str,
    categories: &[String],
    series: &[Series],
) -> Result<String, String> {
    let mut svg = String::new();
    draw(&mut svg, title, y_desc, categories, series).map_err(|e| e.to_string())?;
    Ok(svg)
}

fn draw(
    svg: &mut String,
    title: &str,
    y_desc: &str,
    categories: &[String],
    series: &[Series],
) -> Result<(), Box<dyn std::error::Error>> {
    let width = (200 * categories.len() as u32).clamp(640, 2400);
    let root = SVGBackend::with_string(svg, (width, 480)).into_drawing_area();
    root.fill(&WHITE)?;
    let top = series
        .iter()
        .flat_map(|s| s.values.iter().copied())
        .filter(|v| v.is_finite())
        .fold(0.0_f64, f64::max)
        .max(f64::MIN_POSITIVE)
        * 1.15;
    let groups = categories.len().max(1) as f64;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(70)
        .y_label_area_size(70)
        .build_cartesian_2d(0.0..groups, 0.0..top)?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(0)
        .y_desc(y_desc)
        .draw()?;
    let width = 0.8 / series.len().max(1) as f64;
    for (s, one) in series.iter().enumerate() {
        let color = PALETTE[s % PALETTE.len()];
        chart
            .draw_series(one.values.iter().enumerate().map(|(c, value)| {
                let left = c as f64 + 0.1 + s as f64 * width;
                Rectangle::new([(left, 0.0), (left + width * 0.9, *value)], color.filled())
            }))?
            .label(one.name.clone())
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], color.filled()));
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()?;
    let label = ("sans-serif", 12).into_font().color(&BLACK);
    for (c, name) in categories.iter().enumerate() {
        let (x, y) = chart.backend_coord(&(c as f64 + 0.5, 0.0));
        let shown: String = name.chars().take(28).collect();
        let x = x - (shown.chars().count() as i32 * 3);
        root.draw(&Text::new(shown, (x, y + 10), label.clone()))?;
    }
    root.present()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chart_names_its_categories_and_series() {
        let svg = grouped_bars(
            "req/s",
            "requests per second",
            &["round_robin".to_owned(), "cache_aware".to_owned()],
            &[
                Series {
                    name: "p50".into(),
                    values: vec![99.0, 60.0],
                },
                Series {
                    name: "p99".into(),
                    values: vec![250.0, 101.0],
                },
            ],
        )
        .unwrap();
        assert!(svg.starts_with("<svg"), "{}", &svg[..40]);
        for text in [
            "round_robin",
            "cache_aware",
            "p50",
            "p99",
            "requests per second",
        ] {
            assert!(svg.contains(text), "{text} missing");
        }
        assert!(svg.matches("<rect").count() >= 4);
    }
}
