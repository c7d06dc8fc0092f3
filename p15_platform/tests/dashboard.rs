//! The controller's live page in a real headless browser (Debian's
//! `chromium`; `apt-get install -y chromium` if it is missing): a
//! platform serves a few requests, then the page's screenshot must show
//! both plots (pixels of the "ready" line's green and the TTFT p99 line's
//! red) and the node's server, and the page's data must hold the series
//! those lines draw: one ready replica and a TTFT series with values.

mod support;

use std::time::Duration;

use support::{complete, deployment, ready, Platform};

/// Pixels within a few levels of `rgb`.
fn count(png_path: &std::path::Path, rgb: [u8; 3]) -> usize {
    let decoder = png::Decoder::new(std::fs::File::open(png_path).unwrap());
    let mut reader = decoder.read_info().unwrap();
    let mut buf = vec![0; reader.output_buffer_size()];
    let info = reader.next_frame(&mut buf).unwrap();
    let step = info.color_type.samples();
    buf[..info.buffer_size()]
        .chunks(step)
        .filter(|px| (0..3).all(|i| px[i].abs_diff(rgb[i]) <= 8))
        .count()
}

#[test]
fn the_dashboard_shows_replicas_ttft_and_servers_in_a_browser() {
    let mut p = Platform::start();
    p.agent("n1", 1);
    p.controller("c1");
    let url = p.router(&["dash"], 30_000);
    p.apply(&deployment("dash", ""));
    p.wait_for("one ready server", Duration::from_secs(60), |s| {
        ready(s, "dash").len() == 1
    });
    // Two bursts a few scrapes apart: the second is an increase the
    // controller's once-a-second scrape cannot miss.
    for _ in 0..2 {
        for _ in 0..3 {
            let (code, body, _) = complete(&p.rt, &url, "dash", 4);
            assert_eq!(code, 200, "{body}");
        }
        std::thread::sleep(Duration::from_millis(2500));
    }
    let ctl = p.local.controllers[0].url.clone().unwrap();
    let page =
        p.rt.block_on(async { reqwest::get(&ctl).await.unwrap().text().await.unwrap() });
    assert!(
        page.contains("dash-g"),
        "the node's server is listed:\n{page}"
    );
    assert!(page.contains("<svg"), "the plots are inline SVG");
    // What the plots draw, from the page's own data: one ready replica
    // at the end, and a TTFT series the requests above filled.
    let series = p15_platform::dashboard::page_data(&page, "dash")
        .unwrap_or_else(|| panic!("the page carries the plotted data:\n{page}"));
    let last = series.last().expect("a non-empty history");
    assert_eq!(
        (last.desired, last.running, last.ready),
        (1.0, 1.0, 1.0),
        "the replica lines end at one server: {last:?}"
    );
    let ttft: Vec<(f64, f64)> = series
        .iter()
        .filter_map(|p| Some((p.ttft_p50?, p.ttft_p99?)))
        .collect();
    assert!(!ttft.is_empty(), "no TTFT point was plotted: {series:?}");
    for (p50, p99) in &ttft {
        assert!(
            0.0 < *p50 && p50 <= p99 && *p99 < 60.0,
            "TTFT p50 {p50} s, p99 {p99} s"
        );
    }
    let dir = std::env::temp_dir().join(format!("p15-dash-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let shot = dir.join("dashboard.png");
    p15_platform::dashboard::screenshot(&ctl, &shot, (1000, 1100)).unwrap();
    let green = count(&shot, [44, 160, 44]);
    let red = count(&shot, [214, 39, 40]);
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        green > 100,
        "the ready line is drawn ({green} green pixels)"
    );
    // Each legend swatch is about 16 x 2 pixels: a drawn line is more.
    assert!(red > 100, "the TTFT p99 line is drawn ({red} red pixels)");
}
