//! Byte-level BPE (GPT-2 style), built from GGUF metadata or an HF `tokenizer.json`.
//!
//! encode: split out special (control) tokens literally; pre-tokenize the rest
//! with GPT-2's pattern; map each piece's bytes to printable characters
//! (`bytes_to_unicode`) and their tokens' ids; merge adjacent symbols by
//! lowest merge rank until no merge applies (`bpe.rs`).
//! decode: concatenate token strings and map the characters back to bytes.

use std::collections::HashMap;
use std::path::Path;

use regex::Regex;

use crate::bpe::Merges;
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
    /// (left id, right id) -> (rank, merged id)
    merges: Merges,
    /// Control/user-defined tokens matched literally in text, longest first.
    specials: Vec<(String, u32)>,
    /// The specials as one alternation, longest first, so one scan of the
    /// text finds the earliest (longest on ties); None when there are none.
    special_re: Option<Regex>,
    /// The id of each byte's one-character token (None in a broken vocabulary).
    byte_id: [Option<u32>; 256],
    /// The most bytes any token stands for: a text of b bytes is at least
    /// b / this many tokens (how a server refuses an oversized prompt
    /// before tokenizing it).
    max_token_bytes: usize,
    char_byte: HashMap<char, u8>,
    pattern: Regex,
    pub bos_id: Option<u32>,
    pub eos_id: Option<u32>,
    /// Whether prompts start with BOS (GGUF `tokenizer.ggml.add_bos_token`;
    /// false when the file does not say, as for GPT-2-style BPE in llama.cpp).
    pub add_bos: bool,
    /// The model's Jinja chat template (GGUF `tokenizer.chat_template`), if any.
    pub chat_template: Option<String>,
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
        let mut merges = Vec::with_capacity(merge_lines.len());
        for (rank, line) in merge_lines.iter().enumerate() {
            let (a, b) = line
                .split_once(' ')
                .ok_or_else(|| cfg(format!("merge {rank} `{line}` is not `left right`")))?;
            merges.push((a.to_string(), b.to_string()));
        }
        // 3 = control, 4 = user-defined: matched literally, never split.
        let specials: Vec<u32> = (0..tokens.len())
            .filter(|&i| types[i] == 3 || types[i] == 4)
            .map(|i| i as u32)
            .collect();
        let id_of = |key: &str| h.get_u64(key).ok().and_then(|v| u32::try_from(v).ok());
        let mut tok = Tokenizer::build(
            tokens,
            merges,
            &specials,
            id_of("tokenizer.ggml.bos_token_id"),
            id_of("tokenizer.ggml.eos_token_id"),
        )
        .map_err(cfg)?;
        tok.add_bos = matches!(h.get("tokenizer.ggml.add_bos_token"), Ok(Value::Bool(true)));
        tok.chat_template = h
            .get_str("tokenizer.chat_template")
            .ok()
            .map(str::to_string);
        Ok(tok)
    }

    /// Build from a Hugging Face `tokenizer.json` (model BPE, ByteLevel
    /// pre-tokenizer without a prefix space); BOS/EOS are not defined there.
    pub fn from_tokenizer_json(path: &Path) -> Result<Tokenizer, ModelError> {
        let cfg = |msg: String| ModelError::Config {
            path: path.to_path_buf(),
            msg,
        };
        let text = std::fs::read_to_string(path).map_err(|source| ModelError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let j: serde_json::Value =
            serde_json::from_str(&text).map_err(|source| ModelError::Json {
                path: path.to_path_buf(),
                source,
            })?;
        let model = &j["model"];
        if model["type"] != "BPE" {
            return Err(cfg(format!(
                "model.type is {}, supported: BPE",
                model["type"]
            )));
        }
        let pre = &j["pre_tokenizer"];
        if pre["type"] != "ByteLevel" || pre["add_prefix_space"] == true {
            return Err(cfg(format!(
                "pre_tokenizer {pre} is not supported (ByteLevel without add_prefix_space)"
            )));
        }
        let vocab = model["vocab"]
            .as_object()
            .ok_or_else(|| cfg("model.vocab must be an object".into()))?;
        let added = j["added_tokens"].as_array().cloned().unwrap_or_default();
        let mut by_id: Vec<(u32, String)> = Vec::with_capacity(vocab.len() + added.len());
        for (t, id) in vocab {
            let id = id
                .as_u64()
                .and_then(|v| u32::try_from(v).ok())
                .ok_or_else(|| cfg(format!("vocab id of `{t}` is {id}")))?;
            by_id.push((id, t.clone()));
        }
        let mut specials = Vec::new();
        for a in &added {
            let (Some(id), Some(t)) = (
                a["id"].as_u64().and_then(|v| u32::try_from(v).ok()),
                a["content"].as_str(),
            ) else {
                return Err(cfg(format!("added token {a} needs an id and content")));
            };
            by_id.push((id, t.to_string()));
            specials.push(id);
        }
        let n = by_id
            .iter()
            .map(|(id, _)| *id as usize + 1)
            .max()
            .unwrap_or(0);
        if n > 1 << 24 {
            return Err(cfg(format!("token id {} is beyond the 2^24 cap", n - 1)));
        }
        let mut tokens = vec![String::new(); n];
        for (id, t) in by_id {
            tokens[id as usize] = t;
        }
        let merges = model["merges"]
            .as_array()
            .ok_or_else(|| cfg("model.merges must be an array".into()))?
            .iter()
            .enumerate()
            .map(|(rank, m)| {
                match m {
                    // "left right" (older files) or ["left", "right"] (tokenizers >= 0.20)
                    serde_json::Value::String(line) => line
                        .split_once(' ')
                        .map(|(a, b)| (a.to_string(), b.to_string())),
                    serde_json::Value::Array(p) if p.len() == 2 => p[0]
                        .as_str()
                        .zip(p[1].as_str())
                        .map(|(a, b)| (a.to_string(), b.to_string())),
                    _ => None,
                }
                .ok_or_else(|| {
                    cfg(format!(
                        "merge {rank} is {m}, expected \"left right\" or [left, right]"
                    ))
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        Tokenizer::build(tokens, merges, &specials, None, None).map_err(cfg)
    }

    /// Assemble from id-indexed token strings, ranked merges and the ids of
    /// tokens to match literally.
    fn build(
        tokens: Vec<String>,
        merge_list: Vec<(String, String)>,
        special_ids: &[u32],
        bos: Option<u32>,
        eos: Option<u32>,
    ) -> Result<Tokenizer, String> {
        let n = u32::try_from(tokens.len()).map_err(|_| "more than 2^32 tokens".to_string())?;
        let ids: HashMap<String, u32> = tokens
            .iter()
            .cloned()
            .zip(0..n)
            .filter(|(t, _)| !t.is_empty())
            .collect();
        // Merges on ids; one whose parts or result are not tokens can never
        // produce a token, and is dropped.
        let merges = Merges::new(merge_list.iter().filter_map(|(a, b)| {
            let merged = ids.get(&format!("{a}{b}"))?;
            Some((*ids.get(a)?, *ids.get(b)?, *merged))
        }));
        let mut specials: Vec<(String, u32)> = special_ids
            .iter()
            .filter_map(|&id| {
                tokens
                    .get(id as usize)
                    .filter(|t| !t.is_empty())
                    .map(|t| (t.clone(), id))
            })
            .collect();
        specials.sort_by_key(|s| std::cmp::Reverse(s.0.len()));
        let special_re = if specials.is_empty() {
            None
        } else {
            let alternation: Vec<String> = specials.iter().map(|(s, _)| regex::escape(s)).collect();
            Some(Regex::new(&alternation.join("|")).map_err(|e| format!("special tokens: {e}"))?)
        };
        let byte_char = bytes_to_unicode();
        let byte_id = std::array::from_fn(|b| ids.get(&byte_char[b].to_string()).copied());

        let char_byte = byte_char
            .iter()
            .enumerate()
            .map(|(b, &c)| (c, b as u8))
            .collect();
        let mut tok = Tokenizer {
            tokens,
            ids,
            merges,
            specials,
            special_re,
            byte_id,
            max_token_bytes: 1,
            char_byte,
            pattern: Regex::new(GPT2_PATTERN).expect("constant pattern"),
            bos_id: bos.filter(|&v| v < n),
            eos_id: eos.filter(|&v| v < n),
            add_bos: false,
            chat_template: None,
        };
        // The longest `decode_bytes` of one token (at least 1).
        tok.max_token_bytes = (0..n)
            .map(|id| tok.decode_bytes(&[id]).len())
            .max()
            .unwrap_or(1)
            .max(1);
        Ok(tok)
    }

    pub fn vocab_size(&self) -> usize {
        self.tokens.len()
    }

    /// The token string of `id` (byte-level characters), if it exists.
    pub fn token(&self, id: u32) -> Option<&str> {
        self.tokens.get(id as usize).map(String::as_str)
    }

    /// The most bytes one token decodes to (at least 1).
    pub fn max_token_bytes(&self) -> usize {
        self.max_token_bytes
    }

    pub fn id(&self, token: &str) -> Option<u32> {
        self.ids.get(token).copied()
    }

    /// Text to ids (no BOS added). Linear in the text but for the merges'
    /// log factor: one scan for special tokens, one for pre-tokens, a heap
    /// per pre-token (see [`crate::bpe`]).
    pub fn encode(&self, text: &str) -> Vec<u32> {
        let mut out = Vec::new();
        let mut plain_from = 0;
        if let Some(re) = &self.special_re {
            for m in re.find_iter(text) {
                self.encode_plain(&text[plain_from..m.start()], &mut out, Merges::merge);
                if let Some((_, id)) = self.specials.iter().find(|(s, _)| s == m.as_str()) {
                    out.push(*id);
                }
                plain_from = m.end();
            }
        }
        self.encode_plain(&text[plain_from..], &mut out, Merges::merge);
        out
    }

    /// The reference for [`Tokenizer::encode`]: each special token searched
    /// for separately after each split, and the naive merge loop. Quadratic
    /// in a pre-token's length; for tests.
    pub fn encode_naive(&self, text: &str) -> Vec<u32> {
        let mut out = Vec::new();
        let mut rest = text;
        while !rest.is_empty() {
            // The earliest special token (longest on ties) splits the text.
            let next = self
                .specials
                .iter()
                .filter_map(|(s, id)| rest.find(s.as_str()).map(|at| (at, s.len(), *id)))
                .min_by(|a, b| a.0.cmp(&b.0).then(b.1.cmp(&a.1)));
            let Some((at, len, id)) = next else {
                self.encode_plain(rest, &mut out, Merges::merge_naive);
                break;
            };
            self.encode_plain(&rest[..at], &mut out, Merges::merge_naive);
            out.push(id);
            rest = &rest[at + len..];
        }
        out
    }

    /// Pre-tokenize text with no special tokens in it and merge each piece.
    fn encode_plain(&self, text: &str, out: &mut Vec<u32>, merge: fn(&Merges, &mut Vec<u32>)) {
        let mut ids = Vec::new();
        for piece in pre_tokenize(&self.pattern, text) {
            // One symbol per byte; a byte with no token (a broken
            // vocabulary) is dropped and splits the piece.
            for run in piece
                .as_bytes()
                .split(|&b| self.byte_id[b as usize].is_none())
            {
                ids.clear();
                ids.extend(run.iter().filter_map(|&b| self.byte_id[b as usize]));
                merge(&self.merges, &mut ids);
                out.extend_from_slice(&ids);
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
