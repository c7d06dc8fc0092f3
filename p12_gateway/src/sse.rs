//! Server-sent events as they pass through: split the backend's bytes into
//! whole events (each forwarded as the exact bytes the backend sent, so the
//! client sees byte-identical chunks), and read the usage a stream reports.

use serde_json::Value;

/// Largest event the relay holds while waiting for its end: a backend
/// that never sends a blank line ends its stream instead of growing memory.
pub const MAX_EVENT_BYTES: usize = 4 << 20;

/// An event longer than [`MAX_EVENT_BYTES`].
#[derive(Debug, thiserror::Error)]
#[error("the backend sent an event of more than {MAX_EVENT_BYTES} bytes")]
pub struct EventTooLong;

/// Splits a byte stream into complete events, blank line included.
#[derive(Debug, Default)]
pub struct EventSplitter {
    buf: Vec<u8>,
    /// Bytes of `buf` already searched for an event's end.
    scanned: usize,
}

impl EventSplitter {
    /// Feed bytes; get every event they complete, as raw bytes.
    pub fn push(&mut self, bytes: &[u8]) -> Result<Vec<Vec<u8>>, EventTooLong> {
        self.buf.extend_from_slice(bytes);
        let mut out = Vec::new();
        // Resume a little before the old end: a separator may straddle it.
        while let Some(end) = event_end(&self.buf, self.scanned.saturating_sub(2)) {
            out.push(self.buf.drain(..end).collect());
            self.scanned = 0;
        }
        self.scanned = self.buf.len();
        if self.buf.len() > MAX_EVENT_BYTES {
            return Err(EventTooLong);
        }
        Ok(out)
    }

    /// Bytes of an event never completed (a stream cut off mid-event).
    pub fn rest(&self) -> &[u8] {
        &self.buf
    }
}

/// Index just past the first blank line at or after `from`: a line ends
/// with LF, CRLF or CR, so an event ends at "\n\n", "\r\r" or "\n\r\n"
/// (which also covers "\r\n\r\n").
fn event_end(buf: &[u8], from: usize) -> Option<usize> {
    (from..buf.len()).find_map(|i| {
        let rest = &buf[i..];
        if rest.starts_with(b"\n\n") || rest.starts_with(b"\r\r") {
            Some(i + 2)
        } else if rest.starts_with(b"\n\r\n") {
            Some(i + 3)
        } else {
            None
        }
    })
}

/// The `data:` payload of a raw event (lines joined), if it has one.
pub fn data(event: &[u8]) -> Option<String> {
    let text = std::str::from_utf8(event).ok()?;
    let lines: Vec<&str> = text
        .split(['\n', '\r'])
        .filter_map(|l| l.strip_prefix("data:"))
        .map(|d| d.strip_prefix(' ').unwrap_or(d))
        .collect();
    (!lines.is_empty()).then(|| lines.join("\n"))
}

/// What one event of a completion stream says.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    /// A chunk with choices (text, a finish reason).
    Chunk,
    /// The usage chunk: no choices, `usage` set. (prompt, completion)
    Usage(u64, u64),
    /// An error event.
    Error,
    /// `data: [DONE]`.
    Done,
    /// A comment, keep-alive, or anything else.
    Other,
}

pub fn classify(event: &[u8]) -> Event {
    parse(event).0
}

/// What one event says, and its JSON payload where it has one (parsed
/// once, for a caller that reads more of it).
pub fn parse(event: &[u8]) -> (Event, Option<Value>) {
    let Some(d) = data(event) else {
        return (Event::Other, None);
    };
    if d.trim() == "[DONE]" {
        return (Event::Done, None);
    }
    let Ok(v) = serde_json::from_str::<Value>(&d) else {
        return (Event::Other, None);
    };
    if v.get("error").is_some() {
        return (Event::Error, Some(v));
    }
    let no_choices = v
        .get("choices")
        .and_then(Value::as_array)
        .is_none_or(Vec::is_empty);
    let kind = match usage(&v) {
        Some((p, c)) if no_choices => Event::Usage(p, c),
        _ if !no_choices => Event::Chunk,
        _ => Event::Other,
    };
    (kind, Some(v))
}

/// (prompt_tokens, completion_tokens) of a response or chunk.
pub fn usage(v: &Value) -> Option<(u64, u64)> {
    let u = v.get("usage")?;
    Some((
        u.get("prompt_tokens")?.as_u64()?,
        u.get("completion_tokens")?.as_u64()?,
    ))
}

/// An OpenAI-style error event that ends a stream the gateway could not
/// finish (a started stream is never replayed).
pub fn error_event(message: &str) -> Vec<u8> {
    let body = serde_json::json!({"error": {
        "message": message,
        "type": "upstream_error",
        "param": null,
        "code": "backend_stream_failed",
    }});
    format!("data: {body}\n\n").into_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_split_at_blank_lines_across_any_chunking() {
        let stream =
            b"data: {\"choices\":[{\"text\":\"a\"}]}\n\n: keep-alive\r\n\r\ndata: [DONE]\n\n";
        for cut in 1..stream.len() {
            let mut s = EventSplitter::default();
            let mut events = s.push(&stream[..cut]).unwrap();
            events.extend(s.push(&stream[cut..]).unwrap());
            assert_eq!(events.concat(), stream.to_vec(), "cut at {cut}");
            assert_eq!(events.len(), 3);
            assert!(s.rest().is_empty());
        }
    }

    #[test]
    fn every_line_ending_ends_an_event_and_a_runaway_one_is_refused() {
        let mut s = EventSplitter::default();
        let events = s.push(b"data: a\n\r\ndata: b\r\rdata: c\r\n\r\n").unwrap();
        assert_eq!(
            events,
            [&b"data: a\n\r\n"[..], b"data: b\r\r", b"data: c\r\n\r\n"]
        );
        let mut s = EventSplitter::default();
        let line = vec![b'x'; 1 << 20];
        for _ in 0..4 {
            assert!(s.push(&line).unwrap().is_empty());
        }
        assert!(s.push(b"y").is_err());
    }

    #[test]
    fn usage_and_chunks_are_told_apart() {
        let c = b"data: {\"choices\":[{\"text\":\"a\"}]}\n\n";
        let u = b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":4,\"total_tokens\":7}}\n\n";
        assert_eq!(classify(c), Event::Chunk);
        assert_eq!(classify(u), Event::Usage(3, 4));
        assert_eq!(classify(b"data: [DONE]\n\n"), Event::Done);
        assert_eq!(classify(&error_event("x")), Event::Error);
        assert_eq!(classify(b": ping\n\n"), Event::Other);
    }
}
