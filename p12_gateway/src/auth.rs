//! API keys: `Authorization: Bearer <key>`, checked against SHA-256 hashes
//! (the config never holds a key). The presented key's hash is compared with
//! every stored hash in constant time and without an early exit, so the
//! time taken says nothing about how close a guess came, or which entry
//! matched.

use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

/// A key's identity once authenticated.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Caller {
    /// The key's label (metrics, logs, limits).
    pub key: String,
    pub tenant: String,
    /// Models the tenant may use.
    pub models: Vec<String>,
}

#[derive(Debug)]
struct Entry {
    hash: [u8; 32],
    caller: Caller,
}

/// Every configured key, by hash.
#[derive(Debug)]
pub struct Keys {
    entries: Vec<Entry>,
}

/// Why a request was not authenticated.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AuthError {
    Missing,
    Malformed,
    Unknown,
}

/// The hex SHA-256 of `key`, as the config stores it.
pub fn hash_key(key: &str) -> String {
    Sha256::digest(key.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// 64 hex digits as 32 bytes.
pub fn parse_hash(hex: &str) -> Option<[u8; 32]> {
    let hex = hex.as_bytes();
    if hex.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (o, pair) in out.iter_mut().zip(hex.chunks_exact(2)) {
        let digit = |c: u8| (c as char).to_digit(16);
        *o = (digit(pair[0])? * 16 + digit(pair[1])?) as u8;
    }
    Some(out)
}

impl Keys {
    /// From (sha256 hex, caller) pairs; a malformed hash is skipped (the
    /// config check refuses those first).
    pub fn new(entries: impl IntoIterator<Item = (String, Caller)>) -> Keys {
        Keys {
            entries: entries
                .into_iter()
                .filter_map(|(h, caller)| {
                    Some(Entry {
                        hash: parse_hash(&h)?,
                        caller,
                    })
                })
                .collect(),
        }
    }

    /// The caller behind an `Authorization` header value.
    pub fn authenticate(&self, header: Option<&str>) -> Result<&Caller, AuthError> {
        let header = header.ok_or(AuthError::Missing)?;
        let key = header
            .strip_prefix("Bearer ")
            .map(str::trim)
            .filter(|k| !k.is_empty())
            .ok_or(AuthError::Malformed)?;
        let presented: [u8; 32] = Sha256::digest(key.as_bytes()).into();
        let mut found = None;
        for e in &self.entries {
            // Every entry is compared; no branch on a partial match.
            if bool::from(e.hash.ct_eq(&presented)) {
                found = Some(&e.caller);
            }
        }
        found.ok_or(AuthError::Unknown)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys() -> Keys {
        let caller = Caller {
            key: "alice".into(),
            tenant: "a".into(),
            models: vec!["m".into()],
        };
        Keys::new([(hash_key("sk-alice"), caller)])
    }

    #[test]
    fn sha256_matches_the_standard_vector() {
        // FIPS 180-2's example: SHA-256("abc").
        assert_eq!(
            hash_key("abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        assert_eq!(parse_hash(&hash_key("abc")).unwrap()[0], 0xba);
        assert_eq!(parse_hash("zz"), None);
    }

    #[test]
    fn only_a_bearer_key_with_a_stored_hash_passes() {
        let k = keys();
        assert_eq!(
            k.authenticate(Some("Bearer sk-alice")).unwrap().key,
            "alice"
        );
        assert_eq!(k.authenticate(None), Err(AuthError::Missing));
        assert_eq!(
            k.authenticate(Some("Basic sk-alice")),
            Err(AuthError::Malformed)
        );
        assert_eq!(k.authenticate(Some("Bearer ")), Err(AuthError::Malformed));
        assert_eq!(
            k.authenticate(Some("Bearer sk-alicf")),
            Err(AuthError::Unknown)
        );
    }
}
