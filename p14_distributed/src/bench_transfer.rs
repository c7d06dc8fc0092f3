//! `bench-transfer`: one prompt's K/V pulled over the transfer protocol
//! (hello, accept, 30 layer frames with checksums, ack) against prompt
//! length, beside the same bytes sent as one plain TCP write with a
//! one-byte reply on the same link in the same run (the link's own
//! ceiling). Loopback here; the layout is SmolLM2-135M's (30 layers, 3 K/V
//! heads of 64, blocks of 16: 46,080 bytes per position).

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
    /// Measure without appending to numbers.md.
    #[arg(long)]
    pub no_record: bool,
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

/// A buffer of `tokens` positions of varied (non-zero) floats.
fn filled(layout: KvLayout, tokens: usize) -> KvBuffer {
    let mut b = KvBuffer::zeros(layout, tokens);
    for (i, x) in b.data.iter_mut().enumerate() {
        *x = (i % 1009) as f32 * 0.001 - 0.5;
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

fn tcp_sink() -> Result<String> {
    let l = TcpListener::bind("127.0.0.1:0")?;
    let addr = l.local_addr()?.to_string();
    std::thread::spawn(move || {
        for c in l.incoming() {
            let Ok(mut c) = c else { continue };
            let mut len = [0u8; 8];
            if c.read_exact(&mut len).is_err() {
                continue;
            }
            let mut buf = vec![0u8; u64::from_le_bytes(len) as usize];
            if c.read_exact(&mut buf).is_ok() {
                let _ = c.write_all(&[1]);
            }
        }
    });
    Ok(addr)
}

pub fn run(a: &TransferArgs) -> Result<()> {
    let layout = smollm2_layout();
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?.to_string();
    let server = KvServer::start(
        listener,
        addr.clone(),
        1,
        layout,
        Duration::from_secs(30),
        Faults::default(),
    );
    let sink = tcp_sink()?;
    let mut rows = Vec::new();
    let (mut ours, mut ceiling) = (Vec::new(), Vec::new());
    println!(
        "{:>7} {:>10} {:>14} {:>14} {:>7}",
        "tokens", "MiB", "protocol GB/s", "TCP GB/s", "ratio"
    );
    for &t in &a.tokens {
        let kv = filled(layout, t);
        let prompt: Vec<u32> = (0..t as u32).collect();
        let hash = prompt_hash(&prompt);
        let bytes = (2 * layout.n_layer * layout.n_kv_head * layout.head_dim * t * 4) as f64;
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
            let pulled = kv_client::pull(&h, layout, 1, t, Duration::from_secs(30))?;
            anyhow::ensure!(pulled.kv == kv, "the pulled K/V differs from the sent");
            anyhow::ensure!(
                pulled.bytes as f64 == bytes,
                "payload {} B, want {bytes}",
                pulled.bytes
            );
            let ceil = tcp_once(&sink, &payload)?;
            if rep > 0 {
                p.push(pulled.seconds);
                c.push(ceil);
            }
        }
        let (sp, sc) = (summarize(&p), summarize(&c));
        let ratio = sc.median / sp.median;
        println!(
            "{t:>7} {:>10.2} {:>14.2} {:>14.2} {:>7.2}",
            bytes / (1 << 20) as f64,
            bytes / sp.median / 1e9,
            bytes / sc.median / 1e9,
            ratio
        );
        let what = format!("{t} tokens ({:.2} MiB), loopback", bytes / (1 << 20) as f64);
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
            predict("≈ 2× the TCP write: payload serialised per float, checksummed, and copied into blocks"),
        ));
        rows.extend(Row::rate_median_p95(
            format!("p14 K/V pull bandwidth, {what}"),
            bytes / 1e9,
            &sp,
            "GB/s",
            predict("1.5"),
        ));
        rows.extend(Row::rate_median_p95(
            format!("TCP ceiling (one write, same bytes), {what}"),
            bytes / 1e9,
            &sc,
            "GB/s",
            predict("3"),
        ));
        rows.push(
            Row::new(
                format!("p14 K/V pull / TCP ceiling bandwidth, {what}, ratio of medians"),
                ratio,
                "x",
            )
            .predicted(predict("0.5 (target ≥ 0.8 from 1,024 tokens)")),
        );
        ours.push((t as f64, bytes / sp.median / 1e9));
        ceiling.push((t as f64, bytes / sc.median / 1e9));
    }
    anyhow::ensure!(
        server.stats.held.load(std::sync::atomic::Ordering::SeqCst) == 0,
        "transfers left held"
    );
    let dir = common::assets::workspace_root().join("p14_distributed/plots");
    line_chart(
        &dir.join("transfer_bandwidth.png"),
        Labels {
            title: "one prompt's K/V over loopback (SmolLM2-135M layout)",
            x: "prompt tokens",
            y: "GB/s (at median time)",
        },
        &[
            Series::new("K/V transfer protocol (pull)", ours),
            Series::new("TCP ceiling: one write, same bytes", ceiling),
        ],
        Scale::LogLog,
    )
    .map_err(anyhow::Error::msg)?;
    if !a.no_record {
        Recorder::for_workspace(command_line("p14_distributed")).append(&rows)?;
    }
    Ok(())
}
