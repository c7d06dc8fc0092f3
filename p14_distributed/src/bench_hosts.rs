//! `bench-hosts`: a prefill worker and a decode worker on two hosts
//! (network namespaces joined by a veth pair shaped to 1, 10 and 25
//! Gbit/s; and on loopback), one core each, and a client beside the decode
//! worker playing the proxy's part. Per prompt length it measures
//!
//! - one request the disaggregated way, its TTFT split into the prefill
//!   worker's queue and prefill, the K/V pull, and the rest (the two HTTP
//!   hops and the import between decode steps); then the first decode step;
//! - the same length recomputed by the decode worker itself (no K/V sent):
//!   what a load failure costs, and what sending the K/V saves;
//!
//! and, per link, the shortest prompt (of those measured) from which
//! sending the K/V is faster than recomputing it. etcd and NATS run on the
//! decode host; the prefill worker reaches them over the link.

use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args;
use common::numbers::{command_line, Recorder, Row};
use common::plot::{line_chart, Labels, Scale, Series};
use common::stats::summarize;
use futures_util::StreamExt;
use p05_kv_cache::generate::GenerateParams;

use crate::cluster::{self, EtcdCluster, Nats, Proc};
use crate::netns::{Host, Shape, TwoHosts};
use crate::wire::{DecodeOrder, LoadFailurePolicy, PrefillReply, WireEvent, WirePrepared};

#[derive(Clone, Debug, Args)]
pub struct HostsArgs {
    /// Links: `loopback`, `veth` (unshaped) or a rate in Mbit/s.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "loopback,1000,10000,25000"
    )]
    pub links: Vec<String>,
    /// Prompt lengths, comma separated.
    #[arg(long, value_delimiter = ',', default_value = "128,512,1024,2048")]
    pub tokens: Vec<usize>,
    /// Timed requests per length and path (after one warm-up).
    #[arg(long, default_value_t = 5)]
    pub reps: usize,
    /// Measure without appending to numbers.md.
    #[arg(long)]
    pub no_record: bool,
}

/// One disaggregated request's times, seconds.
#[derive(Clone, Copy, Debug, Default)]
struct Split {
    ttft: f64,
    queue: f64,
    prefill: f64,
    pull: f64,
    /// After the prefill's reply: the decode hop, the pull and the import.
    send: f64,
    first_decode: f64,
}

/// Distinct tokens per (salt, i): no prefix-cache hit between requests.
fn prompt(salt: u64, n: usize) -> Vec<u32> {
    let mut x = salt.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            1000 + (x % 40_000) as u32
        })
        .collect()
}

fn prepared(tokens: Vec<u32>) -> WirePrepared {
    WirePrepared::new(tokens, &GenerateParams::greedy(2), Vec::new())
}

/// POST an order to `/decode`; (seconds to `admitted`, to the first
/// token, the pull's seconds).
async fn decode(http: &reqwest::Client, url: &str, order: &DecodeOrder) -> Result<(f64, f64, f64)> {
    let t0 = Instant::now();
    let r = http
        .post(format!("{url}/decode"))
        .json(order)
        .send()
        .await?;
    anyhow::ensure!(r.status().is_success(), "decode: status {}", r.status());
    let mut body = r.bytes_stream();
    let (mut buf, mut admitted, mut pull) = (Vec::new(), None, 0.0);
    while let Some(chunk) = tokio::time::timeout(Duration::from_secs(120), body.next())
        .await
        .context("decode: no event for 120 s")?
    {
        buf.extend_from_slice(&chunk?);
        while let Some(nl) = buf.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = buf.drain(..=nl).collect();
            if line.iter().all(u8::is_ascii_whitespace) {
                continue; // a keepalive
            }
            match serde_json::from_slice::<WireEvent>(&line)? {
                WireEvent::Admitted { pull_s, .. } => {
                    admitted = Some(t0.elapsed().as_secs_f64());
                    pull = pull_s;
                }
                WireEvent::Token(_) => {
                    let a = admitted.context("a token before `admitted`")?;
                    return Ok((a, t0.elapsed().as_secs_f64(), pull));
                }
                WireEvent::Done { .. } => bail!("decode: done before a token"),
                WireEvent::Error(e) => bail!("decode: {}", e.message),
            }
        }
    }
    bail!("decode: the stream ended before a token")
}

/// One request the disaggregated way.
async fn disaggregated(
    http: &reqwest::Client,
    (p_url, d_url): (&str, &str),
    tokens: Vec<u32>,
) -> Result<Split> {
    let t0 = Instant::now();
    let prep = prepared(tokens);
    let reply: PrefillReply = http
        .post(format!("{p_url}/prefill"))
        .json(&prep)
        .send()
        .await?
        .json()
        .await?;
    let PrefillReply::Transfer {
        handle,
        queue_s,
        prefill_s,
        ..
    } = reply
    else {
        bail!("prefill: no transfer ({reply:?})");
    };
    let t1 = t0.elapsed().as_secs_f64();
    let order = DecodeOrder {
        request_id: "bench-hosts".into(),
        prepared: prep,
        handle: Some(handle),
        already_sent: 1,
        policy: LoadFailurePolicy::Fail,
    };
    let (admitted, token, pull) = decode(http, d_url, &order).await?;
    Ok(Split {
        ttft: t1 + admitted,
        queue: queue_s,
        prefill: prefill_s,
        pull,
        send: admitted,
        first_decode: token - admitted,
    })
}

/// One request streamed layer by layer while it is prefilled: seconds to
/// its first token (which the decode worker sends on, from the trailer).
async fn layerwise(
    http: &reqwest::Client,
    (p_url, d_url): (&str, &str),
    tokens: Vec<u32>,
) -> Result<f64> {
    let t0 = Instant::now();
    let prep = prepared(tokens);
    let reply: PrefillReply = http
        .post(format!("{p_url}/prefill_stream"))
        .json(&prep)
        .send()
        .await?
        .json()
        .await?;
    let PrefillReply::Started { handle } = reply else {
        bail!("prefill_stream: not started ({reply:?})");
    };
    let order = DecodeOrder {
        request_id: "bench-hosts-layerwise".into(),
        prepared: prep,
        handle: Some(handle),
        already_sent: 0,
        policy: LoadFailurePolicy::Fail,
    };
    let t1 = t0.elapsed().as_secs_f64();
    Ok(t1 + decode(http, d_url, &order).await?.1)
}

/// The same length recomputed on the decode worker: seconds to its
/// first token.
async fn recomputed(http: &reqwest::Client, d_url: &str, tokens: Vec<u32>) -> Result<f64> {
    let order = DecodeOrder {
        request_id: "bench-hosts-recompute".into(),
        prepared: prepared(tokens),
        handle: None,
        already_sent: 0,
        policy: LoadFailurePolicy::Recompute,
    };
    Ok(decode(http, d_url, &order).await?.1)
}

/// etcd, NATS and the decode worker on the decode host, the prefill
/// worker on the prefill host; their control URLs.
struct Rig {
    _etcd: EtcdCluster,
    _nats: Nats,
    _workers: Vec<Proc>,
    p_url: String,
    d_url: String,
}

/// Run `f` where host `h`'s children live: its kept thread, or here on
/// loopback.
fn kept<T: Send + 'static>(
    hosts: Option<&TwoHosts>,
    h: Host,
    f: impl FnOnce() -> Result<T> + Send + 'static,
) -> Result<T> {
    match hosts {
        Some(x) => x.on_kept(h, f)?,
        None => f(),
    }
}

fn start_rig(hosts: Option<&TwoHosts>) -> Result<Rig> {
    let on = |h: Host| hosts.map_or("127.0.0.1".to_string(), |x| x.addr(h).to_string());
    let d_ip = on(Host::Decode);
    let (etcd, nats) = kept(hosts, Host::Decode, move || {
        Ok((EtcdCluster::start(1, &d_ip)?, Nats::start(&d_ip)?))
    })?;
    let exe = std::env::current_exe()?;
    let worker = |role: &'static str, host: Host, cpu: usize| {
        let args: Vec<String> = [
            "--etcd",
            &etcd.urls[0],
            "--nats",
            &nats.url,
            "--host",
            &on(host),
            "--cpu",
            &cpu.to_string(),
            "--kv-cache-mib",
            "512",
            "--id",
            role,
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let exe = exe.clone();
        kept(hosts, host, move || {
            cluster::start_worker(&exe, role, &args)
        })
    };
    let (p, p_url) = worker("prefill", Host::Prefill, 0)?;
    let (d, d_url) = worker("decode", Host::Decode, 1)?;
    Ok(Rig {
        _etcd: etcd,
        _nats: nats,
        _workers: vec![p, d],
        p_url,
        d_url,
    })
}

/// Per length: the splits, the recomputes' seconds, the layer-wise
/// TTFTs.
type Measured = Vec<(usize, Vec<Split>, Vec<f64>, Vec<f64>)>;

fn measure(a: &HostsArgs, rig: &Rig, link: usize) -> Result<Measured> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let http = reqwest::Client::new();
    let urls = (rig.p_url.as_str(), rig.d_url.as_str());
    rt.block_on(async {
        let mut out = Vec::new();
        for (li, &t) in a.tokens.iter().enumerate() {
            let (mut splits, mut recs, mut lws) = (Vec::new(), Vec::new(), Vec::new());
            for rep in 0..=a.reps {
                let salt = ((link * 64 + li) * 1024 + rep) as u64 * 3;
                let s = disaggregated(&http, urls, prompt(salt, t)).await?;
                let r = recomputed(&http, urls.1, prompt(salt + 1, t)).await?;
                let lw = layerwise(&http, urls, prompt(salt + 2, t)).await?;
                if rep > 0 {
                    splits.push(s);
                    recs.push(r);
                    lws.push(lw);
                }
            }
            out.push((t, splits, recs, lws));
        }
        Ok(out)
    })
}

fn median(v: impl Iterator<Item = f64>) -> f64 {
    summarize(&v.collect::<Vec<_>>()).median
}

pub fn run(a: &HostsArgs) -> Result<()> {
    let shapes = a
        .links
        .iter()
        .map(|l| Shape::parse_link(l).map_err(anyhow::Error::msg))
        .collect::<Result<Vec<_>>>()?;
    let mut results: Vec<(String, Measured)> = Vec::new();
    if shapes.contains(&None) {
        let rig = start_rig(None)?;
        results.push(("loopback".into(), measure(a, &rig, 0)?));
    }
    if shapes.iter().any(Option::is_some) {
        let hosts = TwoHosts::new()?;
        let rig = start_rig(Some(&hosts))?;
        for (i, s) in shapes.iter().enumerate() {
            let Some(s) = s else { continue };
            hosts.set_link(*s)?;
            let m = hosts.in_host(Host::Decode, || measure(a, &rig, i + 1))??;
            results.push((format!("{} veth between two namespaces", s.name()), m));
        }
    }
    let mut rows = Vec::new();
    let mut series = Vec::new();
    let mut recompute_curve = Vec::new();
    for (name, m) in &results {
        println!("{name}:");
        println!(
            "{:>6} {:>9} {:>8} {:>9} {:>8} {:>8} {:>9} {:>10} {:>10}",
            "tokens",
            "TTFT ms",
            "queue",
            "prefill",
            "pull",
            "send",
            "decode 1",
            "recompute",
            "layerwise"
        );
        let mut shortest = None;
        let mut send_curve = Vec::new();
        for (t, splits, recs, lws) in m {
            let med = |f: fn(&Split) -> f64| median(splits.iter().map(f)) * 1e3;
            let (send, rec) = (med(|s| s.send), median(recs.iter().copied()) * 1e3);
            let sl = summarize(lws);
            println!(
                "{t:>6} {:>9.1} {:>8.1} {:>9.1} {:>8.1} {:>8.1} {:>9.1} {:>10.1} {:>10.1}",
                med(|s| s.ttft),
                med(|s| s.queue),
                med(|s| s.prefill),
                med(|s| s.pull),
                send,
                med(|s| s.first_decode),
                rec,
                sl.median * 1e3
            );
            let what = format!("{t} tokens, {name}");
            let ttft: Vec<f64> = splits.iter().map(|s| s.ttft).collect();
            let st = summarize(&ttft);
            let big = *t == 1024;
            rows.extend(Row::median_p95(
                format!("p14 TTFT, 1P1D one core each, {what}"),
                st.median * 1e3,
                st.p95 * 1e3,
                "ms",
                if big { "2100" } else { "" },
            ));
            if big {
                for (part, v, guess) in [
                    ("prefill worker's queue", med(|s| s.queue), "1"),
                    ("prefill", med(|s| s.prefill), "2000"),
                    ("K/V pull", med(|s| s.pull), "20 at ≥ 10 Gbit/s, 400 at 1"),
                    ("decode hop, pull and import", send, "35"),
                    ("first decode step", med(|s| s.first_decode), "15"),
                ] {
                    rows.push(
                        Row::new(
                            format!("p14 TTFT split, {what}: {part}, median of {}", splits.len()),
                            v,
                            "ms",
                        )
                        .predicted(guess),
                    );
                }
            }
            rows.extend(Row::median_p95(
                format!("p14 TTFT, K/V streamed layer by layer during the prefill, {what}"),
                sl.median * 1e3,
                sl.p95 * 1e3,
                "ms",
                if big {
                    "2350 (the pull hidden behind the prefill)"
                } else {
                    ""
                },
            ));
            rows.push(
                Row::new(
                    format!(
                        "p14 TTFT layer by layer / after the prefill, {what}, ratio of medians"
                    ),
                    sl.median / st.median,
                    "x",
                )
                .predicted(if big {
                    "0.86 at 1 Gbit/s, 0.99 at ≥ 10"
                } else {
                    ""
                }),
            );
            let sr = summarize(recs);
            rows.extend(Row::median_p95(
                format!("p14 recompute on the decode worker (no K/V sent), to first token, {what}"),
                sr.median * 1e3,
                sr.p95 * 1e3,
                "ms",
                if big { "2000" } else { "" },
            ));
            rows.push(
                Row::new(
                    format!(
                        "p14 recompute / send K/V (hop, pull, import), {what}, ratio of medians"
                    ),
                    rec / send,
                    "x",
                )
                .predicted(if big {
                    "50 at ≥ 10 Gbit/s, 5 at 1"
                } else {
                    ""
                }),
            );
            if send < rec && shortest.is_none() {
                shortest = Some(*t);
            }
            send_curve.push((*t as f64, send));
            if results.first().is_some_and(|(n, _)| n == name) {
                recompute_curve.push((*t as f64, rec));
            }
        }
        let first = m.first().map_or(0, |x| x.0);
        rows.push(
            Row::new(
                format!(
                    "p14 shortest prompt (of {:?}) from which sending K/V beats recomputing it, {name}",
                    a.tokens
                ),
                shortest.map_or(f64::NAN, |t| t as f64),
                "tokens",
            )
            .predicted(format!("{first} (a CPU prefills slower than any of these links sends)")),
        );
        series.push(Series::new(format!("send K/V, {name}"), send_curve));
    }
    series.push(Series::new(
        "recompute on the decode worker",
        recompute_curve,
    ));
    let dir = common::assets::workspace_root().join("p14_distributed/plots");
    line_chart(
        &dir.join("send_vs_recompute.png"),
        Labels {
            title: "a prompt's K/V: sent over each link, or recomputed (one core)",
            x: "prompt tokens",
            y: "ms (median)",
        },
        &series,
        Scale::LogLog,
    )
    .map_err(anyhow::Error::msg)?;
    if !a.no_record {
        Recorder::for_workspace(command_line("p14_distributed")).append(&rows)?;
    }
    Ok(())
}
