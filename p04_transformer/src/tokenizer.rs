//! Byte-level BPE (GPT-2 style), built from GGUF metadata.
//!
//! encode: split out special (control) tokens literally; pre-tokenize the rest
//! with GPT-2's pattern; map each piece's bytes to printable characters
//! (`bytes_to_unicode`); merge adjacent symbols by lowest merge rank until no
//! merge applies; look the symbols up in the vocabulary.
//! decode: concatenate token strings and map the characters back to bytes.

use std::collections::HashMap;

use regex::Regex;

use crate::error::ModelError;
use crate::gguf::{GgufHeader, Value};

/// GPT-2's pre-tokenizer pattern minus its `\s+(?!\S)` look-ahead, which
/// [`pre_tokenize`] emulates (the regex crate has no look-around).
const GPT2_PATTERN: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+";

/// A byte-level BPE tokenizer.
#[derive(Debug)]
pub struct Tokenizer {
    /// id -> token string (in byte-level characters; specials verbatim)
    tokens: Vec<String>,
    ids: HashMap<String, u32>,
    /// (left, right) -> rank
    merges: HashMap<(String, String), usize>,
    /// Control/user-defined tokens matched literally in text, longest first.
    specials: Vec<(String, u32)>,
    byte_char: [char; 256],
    char_byte: HashMap<char, u8>,
    pattern: Regex,
    pub bos_id: Option<u32>,
    pub eos_id: Option<u32>,
}

/// GPT-2's reversible map from bytes to printable characters: printable
/// Latin-1 bytes stand for themselves, the rest are shifted to U+0100 up.
pub fn bytes_to_unicode() -> [char; 256] {
    let mut map = ['\0'; 256];
    let mut n = 0u32;
    for b in 0..=255u8 {
        let printable =
            (b'!'..=b'~').contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b);
        map[b as usize] = if printable {
            char::from(b)
        } else {
            n += 1;
            char::from_u32(255 + n).expect("U+0100..U+0143 are chars")
        };
    }
    map
}

impl Tokenizer {
    /// Build from `tokenizer.ggml.*` metadata (model `gpt2`).
    pub fn from_gguf(h: &GgufHeader) -> Result<Tokenizer, ModelError> {
        let cfg = |msg: String| ModelError::Config {
            path: h.path.clone(),
            msg,
        };
        let model = h.get_str("tokenizer.ggml.model")?;
        if model != "gpt2" {
            return Err(cfg(format!(
                "tokenizer.ggml.model is `{model}`; supported: gpt2 (byte-level BPE)"
            )));
        }
        let strings = |key: &str| -> Result<Vec<String>, ModelError> {
            match h.get(key)? {
                Value::Array(a) => a
                    .iter()
                    .map(|v| match v {
                        Value::String(s) => Ok(s.clone()),
                        other => Err(cfg(format!(
                            "{key} holds {}, expected strings",
                            other.describe()
                        ))),
                    })
                    .collect(),
                other => Err(cfg(format!(
                    "{key} is {}, expected an array of strings",
                    other.describe()
                ))),
            }
        };
        let tokens = strings("tokenizer.ggml.tokens")?;
        let merge_lines = strings("tokenizer.ggml.merges")?;
        let types: Vec<i64> = match h.get("tokenizer.ggml.token_type") {
            Ok(Value::Array(a)) => a
                .iter()
                .map(|v| match v {
                    Value::I32(t) => i64::from(*t),
                    other => other.as_u64().map_or(1, |u| u as i64),
                })
                .collect(),
            _ => vec![1; tokens.len()],
        };
        if types.len() != tokens.len() {
            return Err(cfg(format!(
                "token_type has {} entries for {} tokens",
                types.len(),
                tokens.len()
            )));
        }
        let n = u32::try_from(tokens.len()).map_err(|_| cfg("more than 2^32 tokens".into()))?;
        let ids: HashMap<String, u32> = tokens.iter().cloned().zip(0..n).collect();
        let mut merges = HashMap::with_capacity(merge_lines.len());
        for (rank, line) in merge_lines.iter().enumerate() {
            let (a, b) = line
                .split_once(' ')
                .ok_or_else(|| cfg(format!("merge {rank} `{line}` is not `left right`")))?;
            merges.entry((a.to_string(), b.to_string())).or_insert(rank);
        }
        // 3 = control, 4 = user-defined: matched literally, never split.
        let mut specials: Vec<(String, u32)> = tokens
            .iter()
            .zip(&types)
            .zip(0..n)
            .filter(|((t, &ty), _)| (ty == 3 || ty == 4) && !t.is_empty())
            .map(|((t, _), id)| (t.clone(), id))
            .collect();
        specials.sort_by_key(|s| std::cmp::Reverse(s.0.len()));
        let byte_char = bytes_to_unicode();
        let char_byte = byte_char
            .iter()
            .enumerate()
            .map(|(b, &c)| (c, b as u8))
            .collect();
        let id_of = |key: &str| {
            h.get_u64(key)
                .ok()
                .and_then(|v| u32::try_from(v).ok())
                .filter(|&v| v < n)
        };
        Ok(Tokenizer {
            tokens,
            ids,
            merges,
            specials,
            byte_char,
            char_byte,
            pattern: Regex::new(GPT2_PATTERN).expect("constant pattern"),
            bos_id: id_of("tokenizer.ggml.bos_token_id"),
            eos_id: id_of("tokenizer.ggml.eos_token_id"),
        })
    }

    pub fn vocab_size(&self) -> usize {
        self.tokens.len()
    }

    /// The token string of `id` (byte-level characters), if it exists.
    pub fn token(&self, id: u32) -> Option<&str> {
        self.tokens.get(id as usize).map(String::as_str)
    }

    pub fn id(&self, token: &str) -> Option<u32> {
        self.ids.get(token).copied()
    }

    /// Text to ids (no BOS added).
    pub fn encode(&self, text: &str) -> Vec<u32> {
        let mut out = Vec::new();
        let mut rest = text;
        while !rest.is_empty() {
            // The earliest special token (longest on ties) splits the text.
            let next = self
                .specials
                .iter()
                .filter_map(|(s, id)| rest.find(s.as_str()).map(|at| (at, s.len(), *id)))
                .min_by(|a, b| a.0.cmp(&b.0).then(b.1.cmp(&a.1)));
            let (plain, special) = match next {
                Some((at, len, id)) => (&rest[..at], Some((len, id, at))),
                None => (rest, None),
            };
            for piece in pre_tokenize(&self.pattern, plain) {
                self.bpe(piece, &mut out);
            }
            match special {
                Some((len, id, at)) => {
                    out.push(id);
                    rest = &rest[at + len..];
                }
                None => break,
            }
        }
        out
    }

    /// BPE over one pre-token: merge the lowest-ranked adjacent pair (leftmost
    /// on ties) until none applies.
    fn bpe(&self, piece: &str, out: &mut Vec<u32>) {
        let mut syms: Vec<String> = piece
            .bytes()
            .map(|b| self.byte_char[b as usize].to_string())
            .collect();
        loop {
            let best = syms
                .windows(2)
                .enumerate()
                .filter_map(|(i, w)| {
                    self.merges
                        .get(&(w[0].clone(), w[1].clone()))
                        .map(|&r| (r, i))
                })
                .min();
            let Some((_, i)) = best else { break };
            let right = syms.remove(i + 1);
            syms[i].push_str(&right);
        }
        for s in syms {
            // Every byte-level character is in a byte-level BPE vocabulary;
            // if one is not (a broken file), fall back to its bytes' ids.
            match self.ids.get(&s) {
                Some(&id) => out.push(id),
                None => out.extend(
                    s.chars()
                        .filter_map(|c| self.ids.get(&c.to_string()).copied()),
                ),
            }
        }
    }

    /// Ids to text. Byte sequences that are not valid UTF-8 become U+FFFD.
    pub fn decode(&self, ids: &[u32]) -> String {
        String::from_utf8_lossy(&self.decode_bytes(ids)).into_owned()
    }

    /// Ids to raw bytes (for incremental, UTF-8-safe streaming).
    pub fn decode_bytes(&self, ids: &[u32]) -> Vec<u8> {
        let mut bytes = Vec::new();
        for &id in ids {
            let Some(t) = self.token(id) else { continue };
            if self.specials.iter().any(|(_, s)| *s == id) {
                bytes.extend_from_slice(t.as_bytes());
                continue;
            }
            for c in t.chars() {
                match self.char_byte.get(&c) {
                    Some(&b) => bytes.push(b),
                    None => bytes.extend_from_slice(c.to_string().as_bytes()),
                }
            }
        }
        bytes
    }

    /// SmolLM2's chat template (ChatML), with its default system prompt when
    /// the conversation has none, ending with the assistant turn opened.
    pub fn chat_prompt(&self, messages: &[(&str, &str)]) -> String {
        let mut s = String::new();
        if messages.first().is_none_or(|m| m.0 != "system") {
            s.push_str("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n");
        }
        for (role, content) in messages {
            s.push_str(&format!("<|im_start|>{role}\n{content}<|im_end|>\n"));
        }
        s.push_str("<|im_start|>assistant\n");
        s
    }
}

/// GPT-2 pre-tokenization. A whitespace run followed by more text gives up its
/// last character to the next piece (the pattern's `\s+(?!\S)`), so " world"
/// keeps its space.
pub fn pre_tokenize<'t>(re: &Regex, text: &'t str) -> Vec<&'t str> {
    let mut out = Vec::new();
    let mut pos = 0;
    while pos < text.len() {
        let Some(m) = re.find_at(text, pos) else {
            break;
        };
        let s = m.as_str();
        let all_space = s.chars().all(char::is_whitespace);
        let last = s.char_indices().last().map_or(0, |(i, _)| i);
        if all_space && m.end() < text.len() && last > 0 {
            out.push(&text[m.start()..m.start() + last]);
            pos = m.start() + last;
        } else {
            out.push(s);
            pos = m.end().max(pos + 1);
        }
    }
    out
}
