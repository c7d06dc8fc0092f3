//! The servers' TTFT as the dashboard plots it, apart from the
//! autoscaler (which decides on load alone). From their own
//! `vllm:time_to_first_token_seconds` histograms: each second the
//! controller takes every ready server's bucket counts, the increase
//! since the last scrape is that second's histogram, and the quantiles
//! over the last 10 s are read off their sum as Prometheus'
//! `histogram_quantile` does (linear within a bucket).

use std::collections::{BTreeMap, VecDeque};

/// The histogram's name on a server's `/metrics`.
pub const TTFT: &str = "vllm:time_to_first_token_seconds";
/// Seconds of increases a quantile is read over.
const WINDOW: usize = 10;

/// Each deployment's last 10 s of TTFT, from one scrape a second.
#[derive(Debug, Default)]
pub struct TtftWindow {
    /// Each ready server's buckets at the last scrape, by URL.
    prev: BTreeMap<String, Vec<(f64, f64)>>,
    /// By deployment, the last seconds' increases (summed over its servers).
    window: BTreeMap<String, VecDeque<Vec<(f64, f64)>>>,
}

impl TtftWindow {
    /// One scrape: by deployment (every one there is: the others are
    /// forgotten), its ready servers' pages (URL, page). A server first
    /// seen now counts from its next scrape.
    pub fn scraped(&mut self, pages: &BTreeMap<String, Vec<(String, String)>>) {
        let mut seen = BTreeMap::new();
        for (deployment, servers) in pages {
            let mut incs = Vec::new();
            for (url, page) in servers {
                let now = buckets(page, TTFT);
                if let Some(before) = self.prev.get(url) {
                    incs.push(increase(&now, before));
                }
                seen.insert(url.clone(), now);
            }
            let w = self.window.entry(deployment.clone()).or_default();
            w.push_back(sum(&incs));
            while w.len() > WINDOW {
                w.pop_front();
            }
        }
        self.prev = seen;
        self.window.retain(|d, _| pages.contains_key(d));
    }

    /// `deployment`'s TTFT p50 and p99 over the window (None: no request
    /// had a first token in it).
    pub fn p50_p99(&self, deployment: &str) -> (Option<f64>, Option<f64>) {
        let h = self.window.get(deployment).map_or(Vec::new(), sum);
        (quantile(0.5, &h), quantile(0.99, &h))
    }
}

/// Cumulative bucket counts `(le, count)` of one histogram in a
/// Prometheus text page, summed over its label sets, by `le`.
pub fn buckets(text: &str, name: &str) -> Vec<(f64, f64)> {
    let prefix = format!("{name}_bucket{{");
    let mut by: BTreeMap<u64, (f64, f64)> = BTreeMap::new();
    for line in text.lines().filter(|l| l.starts_with(&prefix)) {
        let Some(le) = line.split("le=\"").nth(1).and_then(|r| r.split('"').next()) else {
            continue;
        };
        let le: f64 = if le == "+Inf" {
            f64::INFINITY
        } else {
            le.parse().unwrap_or(f64::NAN)
        };
        let Some(v) = line.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()) else {
            continue;
        };
        if le.is_nan() {
            continue;
        }
        by.entry(le.to_bits()).or_insert((le, 0.0)).1 += v;
    }
    let mut v: Vec<(f64, f64)> = by.into_values().collect();
    v.sort_by(|a, b| a.0.total_cmp(&b.0));
    v
}

/// `now - before`, bucket by bucket (a server that restarted counts from 0).
pub fn increase(now: &[(f64, f64)], before: &[(f64, f64)]) -> Vec<(f64, f64)> {
    now.iter()
        .map(|&(le, c)| {
            let b = before.iter().find(|x| x.0 == le).map_or(0.0, |x| x.1);
            (le, if c >= b { c - b } else { c })
        })
        .collect()
}

/// The `q` quantile (0..1) of a cumulative histogram; None when empty.
pub fn quantile(q: f64, h: &[(f64, f64)]) -> Option<f64> {
    let total = h.last()?.1;
    if total <= 0.0 {
        return None;
    }
    let rank = q * total;
    let mut prev = (0.0, 0.0);
    for &(le, c) in h {
        if c >= rank {
            if le.is_infinite() {
                return Some(prev.0); // the highest finite bound
            }
            let span = c - prev.1;
            let f = if span > 0.0 {
                (rank - prev.1) / span
            } else {
                1.0
            };
            return Some(prev.0 + (le - prev.0) * f);
        }
        prev = (le, c);
    }
    Some(prev.0)
}

/// Sum of histograms with the same buckets.
pub fn sum<'a>(hs: impl IntoIterator<Item = &'a Vec<(f64, f64)>>) -> Vec<(f64, f64)> {
    let mut out: Vec<(f64, f64)> = Vec::new();
    for h in hs {
        for &(le, c) in h {
            match out.iter_mut().find(|x| x.0 == le) {
                Some(x) => x.1 += c,
                None => out.push((le, c)),
            }
        }
    }
    out.sort_by(|a, b| a.0.total_cmp(&b.0));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_interpolate_within_a_bucket_as_prometheus_does() {
        // 10 samples: 4 under 0.1, 4 more under 0.5, 2 more under 1.
        let h = [(0.1, 4.0), (0.5, 8.0), (1.0, 10.0), (f64::INFINITY, 10.0)];
        assert_eq!(quantile(0.4, &h), Some(0.1));
        assert!((quantile(0.6, &h).unwrap() - 0.3).abs() < 1e-12); // halfway into 0.1..0.5
        assert!((quantile(0.99, &h).unwrap() - 0.975).abs() < 1e-12);
        assert_eq!(quantile(0.5, &[(0.1, 0.0), (f64::INFINITY, 0.0)]), None);
    }

    #[test]
    fn buckets_sum_label_sets_and_increases_survive_a_restart() {
        let text = "# TYPE x histogram\nx_bucket{m=\"a\",le=\"0.1\"} 1\nx_bucket{m=\"a\",le=\"+Inf\"} 3\n\
                    x_bucket{m=\"b\",le=\"0.1\"} 2\nx_bucket{m=\"b\",le=\"+Inf\"} 2\nx_sum{m=\"a\"} 9\n";
        let b = buckets(text, "x");
        assert_eq!(b, vec![(0.1, 3.0), (f64::INFINITY, 5.0)]);
        assert_eq!(
            increase(&b, &[(0.1, 1.0), (f64::INFINITY, 2.0)]),
            vec![(0.1, 2.0), (f64::INFINITY, 3.0)]
        );
        // A restarted server's counts fell: they count from zero.
        assert_eq!(increase(&[(0.1, 1.0)], &[(0.1, 5.0)]), vec![(0.1, 1.0)]);
        assert_eq!(
            sum(&[b.clone(), b]),
            vec![(0.1, 6.0), (f64::INFINITY, 10.0)]
        );
    }

    fn page(under_01: u32, total: u32) -> String {
        format!("{TTFT}_bucket{{le=\"0.1\"}} {under_01}\n{TTFT}_bucket{{le=\"+Inf\"}} {total}\n")
    }

    /// The window reads increases, not totals: a server's history before
    /// its first scrape does not count, and a second's requests leave the
    /// quantiles after ten scrapes.
    #[test]
    fn the_window_counts_the_increases_of_its_last_ten_seconds() {
        let mut w = TtftWindow::default();
        let at = |w: &mut TtftWindow, a: u32, t: u32| {
            let pages =
                BTreeMap::from([("d".to_string(), vec![("http://s1".to_string(), page(a, t))])]);
            w.scraped(&pages);
        };
        at(&mut w, 0, 100); // 100 slow ones before: not counted
        assert_eq!(w.p50_p99("d"), (None, None));
        at(&mut w, 10, 110); // 10 fast ones this second
        let (p50, p99) = w.p50_p99("d");
        assert!(
            p50.unwrap() <= 0.1 && p99.unwrap() <= 0.1,
            "{p50:?} {p99:?}"
        );
        for _ in 0..10 {
            at(&mut w, 10, 110); // nothing new
        }
        assert_eq!(
            w.p50_p99("d"),
            (None, None),
            "the fast second left the window"
        );
    }
}
