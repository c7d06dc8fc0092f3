//! `bench-transfer`: one prompt's K/V pulled over the transfer protocol
//! (hello, accept, 30 layer frames with checksums, ack) against prompt
//! length, beside the same bytes sent as one plain TCP write with a
//! one-byte reply on the same link in the same run (the link's own
//! ceiling). On loopback, and between two hosts (network namespaces
//! joined by a veth pair, shaped to 1, 10 and 25 Gbit/s). The layout is
//! SmolLM2-135M's (30 layers, 3 K/V heads of 64, blocks of 16: 46,080
//! bytes per position).

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use anyhow::Result;
use clap::Args;
use common::numbers::{command_line, Recorder, Row};
use common::plot::{line_chart, Labels, Scale, Series};
use common::stats::summarize;
use p08_continuous::kv_transfer::{KvBuffer, KvDtype, KvLayout};

use crate::kv_client;
use crate::kv_server::{Faults, KvServer};
use crate::mooncake::Peer;
use crate::netns::{Host, Shape, TwoHosts};
use crate::protocol::prompt_hash;
use crate::wire::TransferHandle;

#[derive(Clone, Debug, Args)]
pub struct TransferArgs {
    /// Prompt lengths (positions), comma separated.
    #[arg(long, value_delimiter = ',', default_value = "128,512,1024,2048,4096")]
    pub tokens: Vec<usize>,
    /// Timed repetitions per length (after one warm-up).
    #[arg(long, default_value_t = 9)]
    pub reps: usize,
    /// Links: `loopback`, `veth` (two hosts, unshaped) or a rate in
    /// Mbit/s (two hosts, the veth shaped by tc tbf), comma separated.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "loopback,1000,10000,25000"
    )]
    pub links: Vec<String>,
    /// Leave out the peer (Mooncake's transfer engine).
    #[arg(long)]
    pub no_mooncake: bool,
    /// Measure without appending to numbers.md.
    #[arg(long)]
    pub no_record: bool,
}

/// Where the two ends of a transfer sit.
#[derive(Clone, Copy, Debug)]
enum Place<'h> {
    Loopback,
    Hosts(&'h TwoHosts, Shape),
}

impl Place<'_> {
    fn name(&self) -> String {
        match self {
            Place::Loopback => "loopback".into(),
            Place::Hosts(_, s) => format!("{} veth between two namespaces", s.name()),
        }
    }

    fn netns(&self, h: Host) -> Option<&str> {
        match self {
            Place::Loopback => None,
            Place::Hosts(hosts, _) => Some(hosts.name(h)),
        }
    }

    fn ip(&self, h: Host) -> String {
        match self {
            Place::Loopback => "127.0.0.1".into(),
            Place::Hosts(hosts, _) => hosts.addr(h).to_string(),
        }
    }

    /// Run `f` on host `h` (here, on loopback).
    fn on<T: Send>(&self, h: Host, f: impl FnOnce() -> Result<T> + Send) -> Result<T> {
        match self {
            Place::Loopback => f(),
            Place::Hosts(hosts, _) => hosts.in_host(h, f)?,
        }
    }
}

fn smollm2_layout() -> KvLayout {
    KvLayout {
        n_layer: 30,
        n_kv_head: 3,
        head_start: 0,
        head_dim: 64,
        block_size: 16,
        dtype: KvDtype::F32,
    }
}

/// A buffer of `tokens` positions of varied (non-zero) floats; the last
/// block's empty slots stay zero (they do not travel).
fn filled(layout: KvLayout, tokens: usize) -> KvBuffer {
    let mut b = KvBuffer::zeros(layout, tokens);
    for (i, x) in b.data.iter_mut().enumerate() {
        *x = (i % 1009) as f32 * 0.001 - 0.5;
    }
    let (bs, last) = (layout.block_size, b.n_blocks() - 1);
    for slot in tokens - last * bs..bs {
        for layer in 0..layout.n_layer {
            for v in [false, true] {
                for h in 0..layout.n_kv_head {
                    let o = layout.offset(layer, v, h, slot);
                    b.block_mut(last)[o..o + layout.head_dim].fill(0.0);
                }
            }
        }
    }
    b
}

/// The ceiling: `bytes` in one write, a one-byte reply.
fn tcp_once(addr: &str, payload: &[u8]) -> Result<f64> {
    let t0 = Instant::now();
    let mut s = TcpStream::connect(addr)?;
    s.set_nodelay(true)?;
    s.write_all(&(payload.len() as u64).to_le_bytes())?;
    s.write_all(payload)?;
    let mut ack = [0u8; 1];
    s.read_exact(&mut ack)?;
    Ok(t0.elapsed().as_secs_f64())
}

fn tcp_sink(ip: &str) -> Result<String> {
    let l = TcpListener::bind(format!("{ip}:0"))?;
    let addr = l.local_addr()?.to_string();
    std::thread::spawn(move || {
        // One buffer for every connection: its pages are mapped after the
        // first (the ceiling pays no page faults).
        let mut buf = Vec::new();
        for c in l.incoming() {
            let Ok(mut c) = c else { continue };
            let mut len = [0u8; 8];
            if c.read_exact(&mut len).is_err() {
                continue;
            }
            buf.resize(u64::from_le_bytes(len) as usize, 0u8);
            if c.read_exact(&mut buf).is_ok() {
                let _ = c.write_all(&[1]);
            }
        }
    });
    Ok(addr)
}

/// GB/s against tokens.
type Curve = Vec<(f64, f64)>;
/// (rows, protocol, ceiling, Mooncake) on one link.
type Measured = (Vec<Row>, Curve, Curve, Curve);

pub fn run(a: &TransferArgs) -> Result<()> {
    let layout = smollm2_layout();
    let links = a
        .links
        .iter()
        .map(|l| Shape::parse_link(l).map_err(anyhow::Error::msg))
        .collect::<Result<Vec<_>>>()?;
    let hosts = match links.iter().any(Option::is_some) {
        true => Some(TwoHosts::new()?),
        false => None,
    };
    let peer = match a.no_mooncake {
        true => None,
        false => Some(Peer::find()?),
    };
    let mut rows = Vec::new();
    let mut series = Vec::new();
    for link in &links {
        let place = match (link, &hosts) {
            (Some(shape), Some(h)) => {
                h.set_link(*shape)?;
                Place::Hosts(h, *shape)
            }
            _ => Place::Loopback,
        };
        let short = match link {
            Some(s) => s.name(),
            None => "loopback".into(),
        };
        println!("{}:", place.name());
        let (r, ours, ceiling, mooncake) = measure(a, layout, place, peer.as_ref())?;
        rows.extend(r);
        series.push(Series::new(format!("protocol (pull), {short}"), ours));
        series.push(Series::new(format!("TCP ceiling, {short}"), ceiling));
        if !mooncake.is_empty() {
            series.push(Series::new(format!("Mooncake TE, {short}"), mooncake));
        }
    }
    drop(hosts);
    let dir = common::assets::workspace_root().join("p14_distributed/plots");
    line_chart(
        &dir.join("transfer_bandwidth.png"),
        Labels {
            title: "one prompt's K/V over each link (SmolLM2-135M layout)",
            x: "prompt tokens",
            y: "GB/s (at median time)",
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

/// Predictions at 1,024 tokens: (protocol GB/s, ceiling GB/s, ratio,
/// Mooncake GB/s).
fn predicted(place: &Place) -> (&'static str, &'static str, &'static str, &'static str) {
    match place {
        Place::Loopback => ("1.5", "1.6", "0.9 (target ≥ 0.8 from 1,024 tokens)", "1.8"),
        Place::Hosts(_, s) => match s.rate_mbit {
            // 1448 of every 1514 bytes on the wire are payload.
            Some(m) if m <= 1000 => ("0.11", "0.12", "0.95 (target ≥ 0.8)", "0.12"),
            // Shaped above what two cores move through a 1500-byte MTU.
            _ => ("0.8", "1.0", "0.8 (target ≥ 0.8)", "1.0"),
        },
    }
}

fn measure(
    a: &TransferArgs,
    layout: KvLayout,
    place: Place,
    peer: Option<&Peer>,
) -> Result<Measured> {
    let bytes_of = |t: usize| 2 * layout.n_layer * layout.n_kv_head * layout.head_dim * t * 4;
    // The peer first, on the same link, the same sizes.
    let (mc, mc_version) = match peer {
        Some(p) => {
            let sizes: Vec<usize> = a.tokens.iter().map(|&t| bytes_of(t)).collect();
            let (recv, send) = (place.ip(Host::Decode), place.ip(Host::Prefill));
            p.measure(
                (place.netns(Host::Decode), &recv),
                (place.netns(Host::Prefill), &send),
                &sizes,
                a.reps,
            )?
        }
        None => (Vec::new(), String::new()),
    };
    let ip = place.ip(Host::Prefill);
    let listener = place.on(Host::Prefill, || Ok(TcpListener::bind(format!("{ip}:0"))?))?;
    let addr = listener.local_addr()?.to_string();
    let server = KvServer::start(
        listener,
        addr.clone(),
        1,
        layout,
        Duration::from_secs(30),
        Faults::default(),
    );
    let sink_ip = place.ip(Host::Decode);
    let sink = place.on(Host::Decode, || tcp_sink(&sink_ip))?;
    let pool = kv_client::RecvPool::new(1);
    let mut rows = Vec::new();
    let (mut ours, mut ceiling, mut mooncake) = (Vec::new(), Vec::new(), Vec::new());
    let guess = predicted(&place);
    println!(
        "{:>7} {:>10} {:>14} {:>14} {:>7} {:>14}",
        "tokens", "MiB", "protocol GB/s", "TCP GB/s", "ratio", "Mooncake GB/s"
    );
    for (i, &t) in a.tokens.iter().enumerate() {
        let kv = filled(layout, t);
        let prompt: Vec<u32> = (0..t as u32).collect();
        let hash = prompt_hash(&prompt);
        let bytes = bytes_of(t) as f64;
        let payload = vec![7u8; bytes as usize];
        let (mut p, mut c) = (Vec::new(), Vec::new());
        for rep in 0..=a.reps {
            let id = server.hold(kv.clone(), hash, b"{}".to_vec());
            let h = TransferHandle {
                kv_addr: addr.clone(),
                transfer_id: id,
                prompt_hash: hash,
                tokens: t,
                lease_ms: 30_000,
            };
            // Kept memory, as a decode worker's blocks are.
            let mut got = pool.take(layout, t);
            let pulled = place.on(Host::Decode, || {
                Ok(kv_client::pull(&h, &mut got, 1, Duration::from_secs(60))?)
            })?;
            anyhow::ensure!(got == kv, "the pulled K/V differs from the sent");
            anyhow::ensure!(
                pulled.bytes as f64 == bytes,
                "payload {} B, want {bytes}",
                pulled.bytes
            );
            let ceil = place.on(Host::Prefill, || tcp_once(&sink, &payload))?;
            pool.give(got);
            if rep > 0 {
                p.push(pulled.seconds);
                c.push(ceil);
            }
        }
        let (sp, sc) = (summarize(&p), summarize(&c));
        let ratio = sc.median / sp.median;
        let sm = mc.get(i).map(|s| summarize(s));
        println!(
            "{t:>7} {:>10.2} {:>14.3} {:>14.3} {:>7.2} {:>14}",
            bytes / (1 << 20) as f64,
            bytes / sp.median / 1e9,
            bytes / sc.median / 1e9,
            ratio,
            sm.as_ref()
                .map_or("-".into(), |m| format!("{:.3}", bytes / m.median / 1e9))
        );
        let what = format!(
            "{t} tokens ({:.2} MiB), {}",
            bytes / (1 << 20) as f64,
            place.name()
        );
        let predict = |s: &str| {
            if t == 1024 {
                s.to_string()
            } else {
                String::new()
            }
        };
        rows.extend(Row::median_p95(
            format!("p14 K/V pull over the protocol, {what}"),
            sp.median * 1e3,
            sp.p95 * 1e3,
            "ms",
            "",
        ));
        rows.extend(Row::rate_median_p95(
            format!("p14 K/V pull bandwidth, {what}"),
            bytes / 1e9,
            &sp,
            "GB/s",
            predict(guess.0),
        ));
        rows.extend(Row::rate_median_p95(
            format!("TCP ceiling (one write, same bytes), {what}"),
            bytes / 1e9,
            &sc,
            "GB/s",
            predict(guess.1),
        ));
        rows.push(
            Row::new(
                format!("p14 K/V pull / TCP ceiling bandwidth, {what}, ratio of medians"),
                ratio,
                "x",
            )
            .predicted(predict(guess.2)),
        );
        if let Some(m) = &sm {
            rows.extend(Row::rate_median_p95(
                format!("Mooncake transfer engine {mc_version} (TCP, transfer_sync_write), {what}"),
                bytes / 1e9,
                m,
                "GB/s",
                predict(guess.3),
            ));
            rows.push(
                Row::new(
                    format!("p14 K/V pull / Mooncake bandwidth, {what}, ratio of medians"),
                    m.median / sp.median,
                    "x",
                )
                .predicted(predict("0.8 (target ≥ 1)")),
            );
            mooncake.push((t as f64, bytes / m.median / 1e9));
        }
        ours.push((t as f64, bytes / sp.median / 1e9));
        ceiling.push((t as f64, bytes / sc.median / 1e9));
    }
    anyhow::ensure!(
        server.stats.held.load(std::sync::atomic::Ordering::SeqCst) == 0,
        "transfers left held"
    );
    Ok((rows, ours, ceiling, mooncake))
}
