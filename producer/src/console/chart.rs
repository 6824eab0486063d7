//! Charts as server-rendered SVG: numbers in, markup out, no script. Every
//! text in a chart is escaped here; the numbers are ours.

use std::fmt::Write;

const W: f64 = 560.0;
const H: f64 = 160.0;
const PAD_L: f64 = 56.0;
const PAD_B: f64 = 22.0;
const PAD_T: f64 = 10.0;
const PAD_R: f64 = 10.0;

/// A series over minutes (Unix minute, value), drawn as a line with its
/// area. No points give an empty chart that says so.
pub fn line(points: &[(u64, f64)], title: &str) -> String {
    let mut svg = open(title);
    let (Some(first), Some(last)) = (points.first(), points.last()) else {
        return empty(svg);
    };
    let (x0, x1) = (first.0, last.0.max(first.0 + 1));
    let top = nice(points.iter().map(|p| p.1).fold(0.0, f64::max));
    let x = |m: u64| PAD_L + (m - x0) as f64 / (x1 - x0) as f64 * (W - PAD_L - PAD_R);
    let y = |v: f64| H - PAD_B - v / top * (H - PAD_B - PAD_T);
    axes(&mut svg, top);
    let mut path = String::new();
    for (i, (m, v)) in points.iter().enumerate() {
        let _ = write!(path, "{}{:.1},{:.1} ", if i == 0 { "M" } else { "L" }, x(*m), y(*v));
    }
    let _ = write!(
        svg,
        r#"<path class="area" d="{path}L{:.1},{:.1} L{:.1},{:.1} Z"/><path class="line" d="{path}"/>"#,
        x(last.0),
        H - PAD_B,
        x(x0),
        H - PAD_B
    );
    span(svg, x0, x1)
}

/// Counts per minute (Unix minute, count) as columns over `from..=to`,
/// the minutes without any at zero.
pub fn minute_columns(points: &[(u64, u64)], from: u64, to: u64, title: &str) -> String {
    let mut svg = open(title);
    if points.iter().all(|p| p.1 == 0) {
        return empty(svg);
    }
    let top = nice(points.iter().map(|p| p.1 as f64).fold(0.0, f64::max));
    axes(&mut svg, top);
    let slot = (W - PAD_L - PAD_R) / (to.saturating_sub(from) + 1) as f64;
    for (m, n) in points.iter().filter(|p| (from..=to).contains(&p.0)) {
        let h = *n as f64 / top * (H - PAD_B - PAD_T);
        let x = PAD_L + (m - from) as f64 * slot;
        let _ = write!(
            svg,
            r#"<rect class="col" x="{x:.1}" y="{:.1}" width="{:.1}" height="{h:.1}"><title>{}: {n}</title></rect>"#,
            H - PAD_B - h,
            (slot * 0.8).max(1.0),
            hhmm(*m)
        );
    }
    span(svg, from, to)
}

/// Bars with labels (attempts per record...).
pub fn bars(items: &[(String, u64)], title: &str) -> String {
    let mut svg = open(title);
    if items.is_empty() {
        return empty(svg);
    }
    let top = nice(items.iter().map(|i| i.1 as f64).fold(0.0, f64::max));
    axes(&mut svg, top);
    let slot = (W - PAD_L - PAD_R) / items.len() as f64;
    for (i, (label, n)) in items.iter().enumerate() {
        let h = *n as f64 / top * (H - PAD_B - PAD_T);
        let x = PAD_L + i as f64 * slot + slot * 0.15;
        let _ = write!(
            svg,
            r#"<rect class="col" x="{x:.1}" y="{:.1}" width="{:.1}" height="{h:.1}"><title>{}: {n}</title></rect><text x="{:.1}" y="{}" class="tick" text-anchor="middle">{}</text>"#,
            H - PAD_B - h,
            slot * 0.7,
            escape(label),
            x + slot * 0.35,
            H - 6.0,
            escape(label)
        );
    }
    svg.push_str("</svg>");
    svg
}

/// Two bars per label, A and B (shares in 0..1, drawn as percentages).
pub fn paired_bars(items: &[(String, f64, f64)], title: &str) -> String {
    let mut svg = open(title);
    if items.is_empty() {
        return empty(svg);
    }
    let top = nice(items.iter().map(|i| i.1.max(i.2) * 100.0).fold(0.0, f64::max));
    axes(&mut svg, top);
    let slot = (W - PAD_L - PAD_R) / items.len() as f64;
    for (i, (label, a, b)) in items.iter().enumerate() {
        for (j, (v, class)) in [(a, "col"), (b, "col-b")].into_iter().enumerate() {
            let h = v * 100.0 / top * (H - PAD_B - PAD_T);
            let x = PAD_L + i as f64 * slot + slot * (0.1 + 0.4 * j as f64);
            let _ = write!(
                svg,
                r#"<rect class="{class}" x="{x:.1}" y="{:.1}" width="{:.1}" height="{h:.1}"><title>{} {}: {:.1}%</title></rect>"#,
                H - PAD_B - h,
                slot * 0.38,
                escape(label),
                if j == 0 { "A" } else { "B" },
                v * 100.0
            );
        }
        let _ = write!(
            svg,
            r#"<text x="{:.1}" y="{}" class="tick" text-anchor="middle">{}</text>"#,
            PAD_L + i as f64 * slot + slot * 0.5,
            H - 6.0,
            escape(label)
        );
    }
    svg.push_str("</svg>");
    svg
}

fn open(title: &str) -> String {
    format!(
        r#"<svg class="chart" viewBox="0 0 {W} {H}" role="img" aria-label="{t}" xmlns="http://www.w3.org/2000/svg"><title>{t}</title>"#,
        t = escape(title)
    )
}

fn empty(mut svg: String) -> String {
    let _ = write!(
        svg,
        r#"<text x="{}" y="{}" class="empty">nothing yet</text></svg>"#,
        W / 2.0 - 36.0,
        H / 2.0
    );
    svg
}

/// The first and last minute under the x axis, and the end of the chart.
fn span(mut svg: String, from: u64, to: u64) -> String {
    let _ = write!(
        svg,
        r#"<text x="{PAD_L}" y="{}" class="tick">{}</text><text x="{}" y="{}" class="tick" text-anchor="end">{}</text></svg>"#,
        H - 6.0,
        hhmm(from),
        W - PAD_R,
        H - 6.0,
        hhmm(to)
    );
    svg
}

fn axes(svg: &mut String, top: f64) {
    for i in 0..=2 {
        let v = top * f64::from(i) / 2.0;
        let y = H - PAD_B - v / top * (H - PAD_B - PAD_T);
        let _ = write!(
            svg,
            r#"<line class="grid" x1="{PAD_L}" x2="{}" y1="{y:.1}" y2="{y:.1}"/><text x="{}" y="{:.1}" class="tick" text-anchor="end">{}</text>"#,
            W - PAD_R,
            PAD_L - 4.0,
            y + 4.0,
            short(v)
        );
    }
}

/// A round number at or above `v` for the top of an axis.
fn nice(v: f64) -> f64 {
    if v.is_nan() || v <= 0.0 {
        return 1.0;
    }
    let p = 10f64.powf(v.log10().floor());
    [1.0, 2.0, 5.0, 10.0]
        .iter()
        .map(|m| m * p)
        .find(|c| *c >= v)
        .unwrap_or(10.0 * p)
}

fn short(v: f64) -> String {
    if v >= 1e6 {
        format!("{:.1}M", v / 1e6)
    } else if v >= 1e3 {
        format!("{:.1}k", v / 1e3)
    } else if v >= 10.0 || v == 0.0 {
        format!("{v:.0}")
    } else {
        format!("{v:.2}")
    }
}

/// `HH:MM UTC` of a Unix minute.
fn hhmm(minute: u64) -> String {
    format!("{:02}:{:02} UTC", (minute / 60) % 24, minute % 60)
}

/// Text for SVG or HTML.
pub fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '&' => out.push_str("&amp;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chart_is_svg_with_its_labels_escaped() {
        let svg = line(&[(100, 1.0), (101, 3.0), (103, 2.0)], "<script>");
        assert!(svg.starts_with("<svg") && svg.ends_with("</svg>"), "{svg}");
        assert!(svg.contains("&lt;script&gt;") && !svg.contains("<script>"));
        assert!(svg.contains("01:40 UTC"), "{svg}");
        let b = bars(&[("1".into(), 10), ("<2>".into(), 3)], "attempts");
        assert!(b.contains("&lt;2&gt;") && b.matches("<rect").count() == 2, "{b}");
        assert!(line(&[], "t").contains("nothing yet"));
        let cols = minute_columns(&[(100, 4), (102, 8)], 99, 103, "t");
        assert_eq!(cols.matches("<rect").count(), 2, "{cols}");
        assert!(minute_columns(&[], 99, 103, "t").contains("nothing yet"));
        assert_eq!((nice(0.0), nice(3.2), nice(42.0), nice(100.0)), (1.0, 5.0, 50.0, 100.0));
        let pairs = paired_bars(&[("E_ENUM label".into(), 0.2, 0.05)], "t");
        assert_eq!(
            (pairs.matches("class=\"col\"").count(), pairs.matches("col-b").count()),
            (1, 1)
        );
    }
}
