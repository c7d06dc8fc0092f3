//! A decode worker's pull: reserve blocks (or take a kept buffer), pull
//! the prompt's K/V from the prefill worker that holds it, then hand the
//! sequence to the model thread; on a failed pull, recompute or fail as
//! the request's policy says.

use tokio::sync::mpsc;

use crate::kv_client;
use crate::wire::{DecodeOrder, LoadFailurePolicy, SeqMeta, WireEvent};
use crate::worker::{Job, Landed, Reserved};
use crate::worker_serve::Ctx;

/// Where a decode worker's pulls land.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum LandIn {
    Blocks,
    Buffer,
}

/// What a pull fills.
enum Dest {
    Blocks(Reserved),
    Buffer(p08_continuous::kv_transfer::KvBuffer),
}

impl Dest {
    /// Unused: lent blocks go home and free (the reservation's drop), a
    /// buffer is kept for the next pull.
    fn give_back(self, pool: &kv_client::RecvPool) {
        match self {
            Dest::Blocks(r) => drop(r),
            Dest::Buffer(b) => pool.give(b),
        }
    }
}

pub(crate) fn pull_then_submit(
    ctx: &Ctx,
    order: DecodeOrder,
    events: mpsc::UnboundedSender<WireEvent>,
    jobs: &std::sync::mpsc::Sender<Job>,
) {
    if ctx.pull_nice > 0 {
        // SAFETY: gettid and setpriority take and return plain integers;
        // on Linux the nice value belongs to a thread, here this one.
        let r = unsafe {
            let tid = libc::gettid() as libc::id_t;
            libc::setpriority(libc::PRIO_PROCESS, tid, ctx.pull_nice)
        };
        if r != 0 {
            eprintln!(
                "decode: nice {}: {}",
                ctx.pull_nice,
                std::io::Error::last_os_error()
            );
        }
    }
    let DecodeOrder {
        prepared,
        handle,
        already_sent,
        policy,
        ..
    } = order;
    // A failed load: recompute here, or end the request with an error.
    let failed = |why: String| match policy {
        LoadFailurePolicy::Recompute => {
            eprintln!("decode: K/V load failed ({why}); recomputing the prompt");
            Some(Job::Recompute {
                prep: prepared.clone(),
                skip: already_sent,
                events: events.clone(),
            })
        }
        LoadFailurePolicy::Fail => {
            let _ = events.send(WireEvent::Error(crate::wire::WireError {
                kind: "internal".into(),
                message: format!("K/V load failed: {why}"),
                param: None,
                retry_after_s: None,
            }));
            None
        }
    };
    let job = match handle {
        None => Some(Job::Recompute {
            prep: prepared.clone(),
            skip: already_sent,
            events: events.clone(),
        }),
        Some(h)
            if h.tokens == 0
                || h.tokens != prepared.prompt.len() + prepared.output.len()
                || h.tokens > ctx.capacity =>
        {
            failed(format!(
                "the transfer holds {} positions for a prompt of {} and {} tokens sampled before; this worker takes 1 to {}",
                h.tokens,
                prepared.prompt.len(),
                prepared.output.len(),
                ctx.capacity
            ))
        }
        Some(h) => {
            // The blocks first: this worker's own, lent by its model thread
            // (a kept buffer when none are free now); then the bytes.
            let max_len = prepared.prompt.len().saturating_add(prepared.max_tokens);
            let computed = prepared.computed_tokens();
            let reserved = match ctx.land_in {
                LandIn::Blocks => Reserved::ask(jobs, &computed, max_len, ctx.pull_timeout),
                LandIn::Buffer => None,
            };
            let mut dest = match reserved {
                Some(r) => Dest::Blocks(r),
                None => Dest::Buffer(ctx.handle.pool.take(ctx.layout, h.tokens)),
            };
            let pulled = match &mut dest {
                Dest::Blocks(r) => match r.lease_mut() {
                    Some(lease) => kv_client::pull(&h, lease, ctx.model_id, ctx.pull_timeout),
                    None => Err(crate::protocol::ProtocolError::Io(std::io::Error::other(
                        "the reserved blocks are gone",
                    ))),
                },
                Dest::Buffer(buf) => kv_client::pull(&h, buf, ctx.model_id, ctx.pull_timeout),
            };
            let got = pulled.map_err(|e| e.to_string()).and_then(|p| {
                let meta: SeqMeta = serde_json::from_slice(&p.meta)
                    .map_err(|e| format!("the transfer's meta: {e}"))?;
                // A streamed prefill's first token comes with its K/V: this
                // worker sends it on.
                let first = meta.first.clone().filter(|_| already_sent == 0);
                let have = already_sent + first.is_some() as usize;
                if meta.finish.is_none() && meta.output.len() != have {
                    return Err(format!(
                        "the transfer carries {} sampled tokens; the client has {already_sent}",
                        meta.output.len()
                    ));
                }
                Ok((p, meta, first))
            });
            match got {
                Ok((p, meta, first)) if meta.finish.is_some() => {
                    // The first token ended the request: nothing to decode.
                    dest.give_back(&ctx.handle.pool);
                    let _ = events.send(WireEvent::Admitted {
                        recomputed: false,
                        kv_bytes: p.bytes,
                        pull_s: p.seconds,
                    });
                    if let Some(t) = first {
                        let _ = events.send(WireEvent::Token(t));
                    }
                    let _ = events.send(WireEvent::Done {
                        finish: meta.finish.unwrap_or_default(),
                        prompt_tokens: meta.prompt_tokens,
                        completion_tokens: meta.completion_tokens,
                    });
                    None
                }
                Ok((p, meta, first)) => {
                    let landed = match dest {
                        Dest::Blocks(r) => r.landed(),
                        Dest::Buffer(buf) => Some(Landed::Buffer(buf)),
                    };
                    match landed {
                        Some(kv) => Some(Job::Import {
                            prep: prepared.clone(),
                            kv,
                            meta: Box::new(meta),
                            bytes: p.bytes,
                            pull_s: p.seconds,
                            first,
                            events: events.clone(),
                        }),
                        None => failed("the reserved blocks are gone".into()),
                    }
                }
                Err(why) => {
                    dest.give_back(&ctx.handle.pool);
                    failed(why)
                }
            }
        }
    };
    let Some(job) = job else { return };
    if jobs.send(job).is_err() {
        let _ = events.send(WireEvent::Error(crate::wire::WireError {
            kind: "unavailable".into(),
            message: "the model thread has stopped".into(),
            param: None,
            retry_after_s: None,
        }));
    }
}
