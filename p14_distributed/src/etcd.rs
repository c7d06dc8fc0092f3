//! etcd through its v3 JSON gateway (`/v3/kv/range`, `/v3/kv/put`,
//! `/v3/lease/grant`, `/v3/lease/keepalive`, `/v3/watch`): the gRPC API
//! as JSON over HTTP, keys and values base64. Chosen over the gRPC client
//! crate because it needs no `protoc` and no gRPC stack in the build (the
//! workspace already speaks HTTP through reqwest), at the cost of a
//! streaming watch parsed by hand.
//!
//! Every call has one deadline for the whole call; within it, the
//! members are tried in turn, round after round, each attempt with a
//! shorter deadline of its own ([`FIRST_ATTEMPT`], doubling each round).
//! A follower whose leader has just died does not refuse a write: it
//! holds it until its own request timeout (7 s by default) while the
//! survivors elect a leader (about 1.3 s with a 1 s election timeout).
//! One deadline per member would wait that out; the short attempt moves
//! on to the next member and comes back once it has a leader.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use base64::engine::general_purpose::STANDARD as B64;
use base64::Engine as _;
use futures_util::StreamExt;
use serde::Deserialize;
use serde_json::{json, Value};
use thiserror::Error;

#[derive(Debug, Error)]
pub enum EtcdError {
    #[error("etcd at {endpoints:?}: {message}")]
    Unreachable {
        endpoints: Vec<String>,
        message: String,
    },
    #[error("etcd answered {status} to {path}: {body}")]
    Status {
        path: String,
        status: u16,
        body: String,
    },
    #[error("etcd answered {path} with {what}")]
    Reply { path: String, what: String },
    #[error("etcd lease {0} has expired")]
    LeaseExpired(i64),
}

/// A key and its value, as read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Kv {
    pub key: String,
    pub value: Vec<u8>,
    pub mod_revision: i64,
    /// The revision that created the key (0 in a watch's delete events).
    pub create_revision: i64,
    /// The lease the key is attached to (0: none).
    pub lease: i64,
}

/// One condition of a transaction (etcd's `Compare`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Compare {
    /// The key was created at this revision (0: the key does not exist).
    /// A leader's fencing token is its key's creation revision: once the
    /// key is gone or recreated by another leader, the compare fails.
    CreateRevision(String, i64),
    /// No key under the prefix was created or changed after this revision
    /// (etcd's compare over a range: every key's mod revision below
    /// `revision + 1`; holds when there is none). A count read at the
    /// revision still holds (deletions only lower it).
    PrefixUnchangedSince(String, i64),
}

/// One operation of a transaction.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Op {
    Put {
        key: String,
        value: Vec<u8>,
        lease: Option<i64>,
    },
    Delete(String),
}

/// A change seen by a watch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WatchEvent {
    Put(Kv),
    Delete(String),
}

/// The first attempt's deadline on one member; each round doubles it,
/// so a slow but live etcd (a loaded machine's fsync) is still waited for.
pub const FIRST_ATTEMPT: Duration = Duration::from_millis(400);

/// Pause between rounds in which every member failed at once (refused
/// the connection, or answered 5xx), so a down cluster is not spun on.
const ROUND_PAUSE: Duration = Duration::from_millis(100);

#[derive(Clone, Debug)]
pub struct Etcd {
    endpoints: Vec<String>,
    http: reqwest::Client,
    /// The whole call's deadline.
    timeout: Duration,
    /// The member that answered last: the next call starts there.
    preferred: Arc<AtomicUsize>,
}

fn b64(s: &[u8]) -> String {
    B64.encode(s)
}

/// The key just past every key starting with `prefix` (etcd's range_end).
pub fn prefix_end(prefix: &str) -> Vec<u8> {
    let mut end = prefix.as_bytes().to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0]
}

fn num(v: &Value) -> Option<i64> {
    match v {
        Value::String(s) => s.parse().ok(),
        Value::Number(n) => n.as_i64(),
        _ => None,
    }
}

#[derive(Deserialize)]
struct RawKv {
    key: String,
    #[serde(default)]
    value: String,
    #[serde(default)]
    mod_revision: Option<Value>,
    #[serde(default)]
    create_revision: Option<Value>,
    #[serde(default)]
    lease: Option<Value>,
}

fn decode_kv(raw: RawKv) -> Option<Kv> {
    let key = String::from_utf8(B64.decode(raw.key).ok()?).ok()?;
    let value = B64.decode(raw.value).ok()?;
    let rev = |v: &Option<Value>| v.as_ref().and_then(num).unwrap_or(0);
    Some(Kv {
        key,
        value,
        mod_revision: rev(&raw.mod_revision),
        create_revision: rev(&raw.create_revision),
        lease: rev(&raw.lease),
    })
}

impl Etcd {
    /// `endpoints`: `http://host:port` of each member; `timeout`: each
    /// call's deadline, all retries included.
    pub fn new(endpoints: Vec<String>, timeout: Duration) -> Etcd {
        let http = reqwest::Client::builder()
            .connect_timeout(timeout.min(FIRST_ATTEMPT))
            .build()
            .unwrap_or_default();
        Etcd {
            endpoints,
            http,
            timeout,
            preferred: Arc::new(AtomicUsize::new(0)),
        }
    }

    pub fn endpoints(&self) -> &[String] {
        &self.endpoints
    }

    /// POST `body` to `path`, trying the members in turn (from the one
    /// that answered last) until one answers or the call's deadline
    /// passes. A write retried after an attempt timed out may have been
    /// applied once already: puts and deletes are idempotent, and a
    /// transaction whose compare then fails is read back by its caller
    /// (see the election's campaign).
    async fn call(&self, path: &str, body: Value) -> Result<Value, EtcdError> {
        let n = self.endpoints.len();
        let deadline = Instant::now() + self.timeout;
        let first = self.preferred.load(Ordering::Relaxed);
        let mut attempt = FIRST_ATTEMPT;
        let mut last = String::from("no endpoints");
        let mut tries = 0usize;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() || n == 0 {
                break;
            }
            let i = (first + tries) % n;
            let ep = &self.endpoints[i];
            tries += 1;
            let sent = Instant::now();
            let r = self
                .http
                .post(format!("{ep}{path}"))
                .json(&body)
                .timeout(attempt.min(left))
                .send()
                .await;
            let text = match r {
                Ok(r) => {
                    let status = r.status().as_u16();
                    match r.text().await {
                        Ok(text) if status == 200 => Some(text),
                        // An unavailable member (no leader, stopping): next.
                        Ok(text) if status >= 500 => {
                            last = format!("{ep}: {status} {text}");
                            None
                        }
                        Ok(text) => {
                            return Err(EtcdError::Status {
                                path: path.into(),
                                status,
                                body: text,
                            })
                        }
                        Err(e) => {
                            last = format!("{ep}: {status}, body unread: {e}");
                            None
                        }
                    }
                }
                Err(e) => {
                    last = format!("{ep}: {e}");
                    None
                }
            };
            if let Some(text) = text {
                self.preferred.store(i, Ordering::Relaxed);
                return serde_json::from_str(&text).map_err(|e| EtcdError::Reply {
                    path: path.into(),
                    what: format!("unreadable JSON ({e})"),
                });
            }
            if tries.is_multiple_of(n) {
                // A round without an answer: longer attempts next round;
                // a pause first if this member failed at once.
                attempt = attempt.saturating_mul(2);
                if sent.elapsed() < ROUND_PAUSE {
                    let left = deadline.saturating_duration_since(Instant::now());
                    tokio::time::sleep(ROUND_PAUSE.min(left)).await;
                }
            }
        }
        Err(EtcdError::Unreachable {
            endpoints: self.endpoints.clone(),
            message: format!(
                "no answer within {:?} ({tries} tries); last: {last}",
                self.timeout
            ),
        })
    }

    /// A lease of `ttl_s` seconds.
    pub async fn grant(&self, ttl_s: i64) -> Result<i64, EtcdError> {
        let v = self
            .call("/v3/lease/grant", json!({ "TTL": ttl_s }))
            .await?;
        v.get("ID").and_then(num).ok_or(EtcdError::Reply {
            path: "/v3/lease/grant".into(),
            what: format!("no lease id: {v}"),
        })
    }

    /// Renew a lease; an expired one is an error (re-register).
    pub async fn keep_alive(&self, lease: i64) -> Result<i64, EtcdError> {
        let v = self
            .call("/v3/lease/keepalive", json!({ "ID": lease.to_string() }))
            .await?;
        let ttl = v.pointer("/result/TTL").and_then(num).unwrap_or(0);
        if ttl <= 0 {
            return Err(EtcdError::LeaseExpired(lease));
        }
        Ok(ttl)
    }

    pub async fn revoke(&self, lease: i64) -> Result<(), EtcdError> {
        self.call("/v3/lease/revoke", json!({ "ID": lease.to_string() }))
            .await
            .map(|_| ())
    }

    pub async fn put(&self, key: &str, value: &[u8], lease: Option<i64>) -> Result<(), EtcdError> {
        let mut body = json!({ "key": b64(key.as_bytes()), "value": b64(value) });
        if let Some(l) = lease {
            body["lease"] = json!(l.to_string());
        }
        self.call("/v3/kv/put", body).await.map(|_| ())
    }

    /// Delete `key`; whether it existed.
    pub async fn delete(&self, key: &str) -> Result<bool, EtcdError> {
        let v = self
            .call("/v3/kv/deleterange", json!({ "key": b64(key.as_bytes()) }))
            .await?;
        Ok(v.get("deleted").and_then(num).unwrap_or(0) > 0)
    }

    /// If every compare holds, do `ops` atomically: whether it did, and
    /// the store's revision after it (etcd's `Txn`; the failure branch is
    /// empty).
    pub async fn txn(&self, compares: &[Compare], ops: &[Op]) -> Result<(bool, i64), EtcdError> {
        let compare: Vec<Value> = compares
            .iter()
            .map(|c| match c {
                Compare::CreateRevision(k, r) => json!({
                    "key": b64(k.as_bytes()), "target": "CREATE", "result": "EQUAL",
                    "create_revision": r.to_string(),
                }),
                Compare::PrefixUnchangedSince(p, r) => json!({
                    "key": b64(p.as_bytes()), "range_end": b64(&prefix_end(p)),
                    "target": "MOD", "result": "LESS",
                    "mod_revision": r.saturating_add(1).to_string(),
                }),
            })
            .collect();
        let success: Vec<Value> = ops
            .iter()
            .map(|o| match o {
                Op::Put { key, value, lease } => {
                    let mut p = json!({ "key": b64(key.as_bytes()), "value": b64(value) });
                    if let Some(l) = lease {
                        p["lease"] = json!(l.to_string());
                    }
                    json!({ "request_put": p })
                }
                Op::Delete(k) => json!({ "request_delete_range": { "key": b64(k.as_bytes()) } }),
            })
            .collect();
        let v = self
            .call(
                "/v3/kv/txn",
                json!({ "compare": compare, "success": success }),
            )
            .await?;
        let ok = v.get("succeeded").and_then(Value::as_bool).unwrap_or(false);
        let rev = v.pointer("/header/revision").and_then(num).unwrap_or(0);
        Ok((ok, rev))
    }

    /// One key, if it exists.
    pub async fn get(&self, key: &str) -> Result<Option<Kv>, EtcdError> {
        let v = self
            .call("/v3/kv/range", json!({ "key": b64(key.as_bytes()) }))
            .await?;
        let first = v
            .pointer("/kvs/0")
            .cloned()
            .and_then(|k| serde_json::from_value::<RawKv>(k).ok())
            .and_then(decode_kv);
        Ok(first)
    }

    /// Every key under `prefix`, and the store's revision.
    pub async fn get_prefix(&self, prefix: &str) -> Result<(Vec<Kv>, i64), EtcdError> {
        let v = self
            .call(
                "/v3/kv/range",
                json!({ "key": b64(prefix.as_bytes()), "range_end": b64(&prefix_end(prefix)) }),
            )
            .await?;
        let rev = v.pointer("/header/revision").and_then(num).unwrap_or(0);
        let kvs: Vec<RawKv> = v
            .get("kvs")
            .cloned()
            .map(serde_json::from_value)
            .transpose()
            .map_err(|e| EtcdError::Reply {
                path: "/v3/kv/range".into(),
                what: format!("kvs: {e}"),
            })?
            .unwrap_or_default();
        Ok((kvs.into_iter().filter_map(decode_kv).collect(), rev))
    }

    /// Watch `prefix` from `revision` on; `on_event` gets each change.
    /// Returns when the stream ends or `idle` passes with nothing from
    /// etcd (its progress notifications keep a live stream busy), with
    /// the last revision seen: the caller resyncs and watches again.
    pub async fn watch(
        &self,
        prefix: &str,
        revision: i64,
        idle: Duration,
        mut on_event: impl FnMut(WatchEvent),
    ) -> Result<i64, EtcdError> {
        let body = json!({ "create_request": {
            "key": b64(prefix.as_bytes()),
            "range_end": b64(&prefix_end(prefix)),
            "start_revision": revision.to_string(),
            "progress_notify": true,
        }});
        let mut last_rev = revision;
        let mut errors = String::new();
        for ep in &self.endpoints {
            // The stream's headers within the client's deadline (a member
            // that accepts and never answers is passed over), then each
            // chunk within `idle`.
            let send = self.http.post(format!("{ep}/v3/watch")).json(&body).send();
            let resp = match tokio::time::timeout(self.timeout, send).await {
                Ok(Ok(r)) if r.status().is_success() => r,
                Ok(Ok(r)) => {
                    errors = format!("{ep}: {}", r.status());
                    continue;
                }
                Ok(Err(e)) => {
                    errors = format!("{ep}: {e}");
                    continue;
                }
                Err(_) => {
                    errors = format!("{ep}: no answer to the watch in {:?}", self.timeout);
                    continue;
                }
            };
            let mut stream = resp.bytes_stream();
            let mut buf: Vec<u8> = Vec::new();
            loop {
                let chunk = match tokio::time::timeout(idle, stream.next()).await {
                    Ok(Some(Ok(c))) => c,
                    _ => return Ok(last_rev),
                };
                buf.extend_from_slice(&chunk);
                // The gateway writes one JSON object per message, newline
                // separated.
                while let Some(nl) = buf.iter().position(|&b| b == b'\n') {
                    let line: Vec<u8> = buf.drain(..=nl).collect();
                    let Ok(v) = serde_json::from_slice::<Value>(&line) else {
                        continue;
                    };
                    if let Some(r) = v.pointer("/result/header/revision").and_then(num) {
                        last_rev = last_rev.max(r);
                    }
                    let events = v
                        .pointer("/result/events")
                        .and_then(Value::as_array)
                        .cloned()
                        .unwrap_or_default();
                    for e in events {
                        let is_delete = e.get("type").and_then(Value::as_str) == Some("DELETE");
                        let Some(kv) = e
                            .get("kv")
                            .cloned()
                            .and_then(|k| serde_json::from_value::<RawKv>(k).ok())
                            .and_then(decode_kv)
                        else {
                            continue;
                        };
                        last_rev = last_rev.max(kv.mod_revision);
                        on_event(match is_delete {
                            true => WatchEvent::Delete(kv.key),
                            false => WatchEvent::Put(kv),
                        });
                    }
                }
            }
        }
        Err(EtcdError::Unreachable {
            endpoints: self.endpoints.clone(),
            message: errors,
        })
    }

    /// The index (in `endpoints`) of the member leading the cluster, from
    /// each member's maintenance status; `None` when none answers or
    /// none names a leader it can be matched to.
    pub async fn leader(&self) -> Option<usize> {
        let mut ids = Vec::new();
        let mut leader = None;
        for ep in &self.endpoints {
            let v: Option<Value> = match self
                .http
                .post(format!("{ep}/v3/maintenance/status"))
                .body("{}")
                .timeout(self.timeout)
                .send()
                .await
            {
                Ok(r) => r.json().await.ok(),
                Err(_) => None,
            };
            let id = v
                .as_ref()
                .and_then(|v| v.pointer("/header/member_id")?.as_str());
            ids.push(id.map(str::to_string));
            leader = leader.or_else(|| v.as_ref()?.get("leader")?.as_str().map(str::to_string));
        }
        let leader = leader?;
        ids.iter()
            .position(|id| id.as_deref() == Some(leader.as_str()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prefix_ends_just_past_its_last_key() {
        assert_eq!(prefix_end("/a/"), b"/a0".to_vec());
        assert_eq!(prefix_end("ab"), b"ac".to_vec());
    }
}
