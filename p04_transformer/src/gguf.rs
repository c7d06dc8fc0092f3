//! GGUF v2/v3 reader that treats the file as hostile.
//!
//! Layout: magic "GGUF", u32 version, u64 tensor count, u64 key-value count;
//! key-values (string key, u32 type, value); tensor infos (string name, u32
//! n_dims, u64 dims[n_dims] with dims[0] the fastest-varying, u32 type, u64
//! offset into the data section); padding to `general.alignment` (default 32);
//! tensor data.
//!
//! Every count, length, offset and size read from the file is checked with
//! checked arithmetic against caps and against the bytes that remain before
//! anything is allocated, so a corrupt file yields a typed error naming the
//! file and field, never a panic or an allocation of the claimed size.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use thiserror::Error;

use crate::dequant::{GgmlType, SUPPORTED_TYPES};

/// Caps on what a header may claim.
pub const MAX_TENSORS: u64 = 1 << 16;
pub const MAX_KV: u64 = 1 << 16;
pub const MAX_STRING: u64 = 1 << 24;
pub const MAX_ARRAY: u64 = 1 << 24;
pub const MAX_DIMS: u32 = 4;
pub const MAX_ALIGNMENT: u64 = 1 << 16;
pub const DEFAULT_ALIGNMENT: u64 = 32;

#[derive(Debug, Error)]
pub enum GgufError {
    #[error("{path}: cannot read: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: truncated reading {what} at byte {offset}: needs {need} bytes, {left} left")]
    Truncated {
        path: PathBuf,
        what: String,
        offset: usize,
        need: u64,
        left: usize,
    },
    #[error("{path}: not a GGUF file (magic {found:?}, expected \"GGUF\")")]
    Magic { path: PathBuf, found: Vec<u8> },
    #[error("{path}: GGUF version {version} is not supported (2 and 3 are)")]
    Version { path: PathBuf, version: u32 },
    #[error("{path}: {what} is {count}, above the limit of {max}")]
    TooMany {
        path: PathBuf,
        what: String,
        count: u64,
        max: u64,
    },
    #[error("{path}: {what} at byte {offset} is not valid UTF-8")]
    Utf8 {
        path: PathBuf,
        what: String,
        offset: usize,
    },
    #[error("{path}: {what}: value type {ty} is not a GGUF type (0..=12){}", if *.nested { "; nested arrays are not supported" } else { "" })]
    ValueType {
        path: PathBuf,
        what: String,
        ty: u32,
        nested: bool,
    },
    #[error("{path}: duplicate {what} `{name}`")]
    Duplicate {
        path: PathBuf,
        what: &'static str,
        name: String,
    },
    #[error("{path}: tensor `{tensor}` has type {ty}; supported: {SUPPORTED_TYPES}")]
    TensorType {
        path: PathBuf,
        tensor: String,
        ty: u32,
    },
    #[error("{path}: tensor `{tensor}`: {problem}")]
    Tensor {
        path: PathBuf,
        tensor: String,
        problem: TensorProblem,
    },
    #[error(
        "{path}: general.alignment is {value}; expected a power of two in 1..={MAX_ALIGNMENT}"
    )]
    Alignment { path: PathBuf, value: u64 },
    #[error("{path}: tensors `{a}` and `{b}` overlap in the data section")]
    Overlap { path: PathBuf, a: String, b: String },
    #[error("{path}: metadata key `{key}` is missing")]
    MissingKey { path: PathBuf, key: String },
    #[error("{path}: metadata key `{key}` is {found}, expected {expected}")]
    KeyType {
        path: PathBuf,
        key: String,
        found: String,
        expected: &'static str,
    },
    #[error("{path}: tensor `{name}` is missing")]
    MissingTensor { path: PathBuf, name: String },
}

/// What is wrong with one tensor's entry in a GGUF file.
#[derive(Debug, Error)]
pub enum TensorProblem {
    #[error("n_dims is {0}, expected 1..={MAX_DIMS}")]
    Rank(u32),
    #[error("dim {dim} is {value}, expected 1..={}", usize::MAX)]
    Dim { dim: u32, value: u64 },
    #[error("dims {0:?} overflow")]
    Overflow(Vec<usize>),
    #[error("dim 0 is {dim0}, not a multiple of the {ty:?} block size {block}")]
    Block {
        dim0: usize,
        ty: GgmlType,
        block: usize,
    },
    #[error("offset {offset} is not a multiple of the alignment {alignment}")]
    Misaligned { offset: u64, alignment: usize },
    #[error("data at offset {offset} + {n_bytes} bytes lies outside the file ({file_len} bytes, data section at {data_start})")]
    OutsideFile {
        offset: u64,
        n_bytes: usize,
        file_len: usize,
        data_start: usize,
    },
    #[error(transparent)]
    Dequant(#[from] crate::dequant::DequantError),
    #[error(transparent)]
    Shape(#[from] common::TensorError),
}

/// A metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    /// Elements all of one (non-array) type.
    Array(Vec<Value>),
    U64(u64),
    I64(i64),
    F64(f64),
}

impl Value {
    /// Short description for errors: "u32 7", "string", "array[3]".
    pub fn describe(&self) -> String {
        match self {
            Value::String(_) => "a string".into(),
            Value::Array(a) => format!("an array of {}", a.len()),
            other => format!("{other:?}"),
        }
    }

    /// Any integer type as u64 (negative values are `None`).
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v.into()),
            Value::U16(v) => Some(v.into()),
            Value::U32(v) => Some(v.into()),
            Value::U64(v) => Some(v),
            Value::I8(v) => u64::try_from(v).ok(),
            Value::I16(v) => u64::try_from(v).ok(),
            Value::I32(v) => u64::try_from(v).ok(),
            Value::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v.into()),
            Value::F64(v) => Some(v),
            _ => self.as_u64().map(|v| v as f64),
        }
    }
}

/// One tensor's description; `start..start + n_bytes` is inside the file.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorInfo {
    pub name: String,
    /// ggml order: dims[0] varies fastest (a row-major (rows, cols) matrix is [cols, rows]).
    pub dims: Vec<usize>,
    pub ty: GgmlType,
    /// Absolute byte offset in the file.
    pub start: usize,
    pub n_bytes: usize,
}

impl TensorInfo {
    pub fn numel(&self) -> usize {
        self.dims.iter().product()
    }

    /// Row-major shape (dims reversed).
    pub fn shape(&self) -> Vec<usize> {
        self.dims.iter().rev().copied().collect()
    }
}

/// Everything before the tensor data, validated.
#[derive(Clone, Debug)]
pub struct GgufHeader {
    pub path: PathBuf,
    pub version: u32,
    pub metadata: BTreeMap<String, Value>,
    pub tensors: Vec<TensorInfo>,
    pub alignment: usize,
    /// Absolute offset of the data section.
    pub data_start: usize,
}

struct Cursor<'a> {
    b: &'a [u8],
    pos: usize,
    path: &'a Path,
}

impl<'a> Cursor<'a> {
    fn left(&self) -> usize {
        self.b.len() - self.pos
    }

    fn truncated(&self, what: &str, need: u64) -> GgufError {
        GgufError::Truncated {
            path: self.path.to_path_buf(),
            what: what.to_string(),
            offset: self.pos,
            need,
            left: self.left(),
        }
    }

    fn take(&mut self, n: u64, what: &str) -> Result<&'a [u8], GgufError> {
        match usize::try_from(n) {
            Ok(n) if n <= self.left() => {
                let s = &self.b[self.pos..self.pos + n];
                self.pos += n;
                Ok(s)
            }
            _ => Err(self.truncated(what, n)),
        }
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N], GgufError> {
        let s = self.take(N as u64, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn u32(&mut self, what: &str) -> Result<u32, GgufError> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &str) -> Result<u64, GgufError> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    fn count(&mut self, what: &str, max: u64) -> Result<u64, GgufError> {
        let n = self.u64(what)?;
        if n > max {
            return Err(GgufError::TooMany {
                path: self.path.to_path_buf(),
                what: what.to_string(),
                count: n,
                max,
            });
        }
        Ok(n)
    }

    fn string(&mut self, what: &str) -> Result<String, GgufError> {
        let len = self.count(&format!("{what} length"), MAX_STRING)?;
        let at = self.pos;
        let bytes = self.take(len, what)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| GgufError::Utf8 {
            path: self.path.to_path_buf(),
            what: what.to_string(),
            offset: at,
        })
    }

    fn value(&mut self, ty: u32, what: &str, in_array: bool) -> Result<Value, GgufError> {
        Ok(match ty {
            0 => Value::U8(u8::from_le_bytes(self.array(what)?)),
            1 => Value::I8(i8::from_le_bytes(self.array(what)?)),
            2 => Value::U16(u16::from_le_bytes(self.array(what)?)),
            3 => Value::I16(i16::from_le_bytes(self.array(what)?)),
            4 => Value::U32(u32::from_le_bytes(self.array(what)?)),
            5 => Value::I32(i32::from_le_bytes(self.array(what)?)),
            6 => Value::F32(f32::from_le_bytes(self.array(what)?)),
            7 => Value::Bool(self.array::<1>(what)?[0] != 0),
            8 => Value::String(self.string(what)?),
            9 if !in_array => {
                let elem = self.u32(&format!("{what} element type"))?;
                let n = self.count(&format!("{what} element count"), MAX_ARRAY)?;
                // Check the bytes exist before allocating for them.
                let min = match elem {
                    0 | 1 | 7 => 1,
                    2 | 3 => 2,
                    4..=6 => 4,
                    8 | 10..=12 => 8,
                    _ => 0,
                };
                if min == 0 {
                    return Err(GgufError::ValueType {
                        path: self.path.to_path_buf(),
                        what: format!("{what} elements"),
                        ty: elem,
                        nested: elem == 9,
                    });
                }
                if n.checked_mul(min)
                    .is_none_or(|need| need > self.left() as u64)
                {
                    return Err(
                        self.truncated(&format!("{what} ({n} elements)"), n.saturating_mul(min))
                    );
                }
                let mut v = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    v.push(self.value(elem, what, true)?);
                }
                Value::Array(v)
            }
            10 => Value::U64(u64::from_le_bytes(self.array(what)?)),
            11 => Value::I64(i64::from_le_bytes(self.array(what)?)),
            12 => Value::F64(f64::from_le_bytes(self.array(what)?)),
            _ => {
                return Err(GgufError::ValueType {
                    path: self.path.to_path_buf(),
                    what: what.to_string(),
                    ty,
                    nested: ty == 9,
                })
            }
        })
    }
}

/// Parse and validate a GGUF header over the whole file's bytes.
pub fn parse(bytes: &[u8], path: &Path) -> Result<GgufHeader, GgufError> {
    let mut c = Cursor {
        b: bytes,
        pos: 0,
        path,
    };
    let magic = c.take(4, "magic")?;
    if magic != b"GGUF" {
        return Err(GgufError::Magic {
            path: path.to_path_buf(),
            found: magic.to_vec(),
        });
    }
    let version = c.u32("version")?;
    if !(2..=3).contains(&version) {
        return Err(GgufError::Version {
            path: path.to_path_buf(),
            version,
        });
    }
    let n_tensors = c.count("tensor count", MAX_TENSORS)?;
    let n_kv = c.count("metadata key-value count", MAX_KV)?;

    let mut metadata = BTreeMap::new();
    for i in 0..n_kv {
        let key = c.string(&format!("metadata key {i}"))?;
        let ty = c.u32(&format!("type of `{key}`"))?;
        let v = c.value(ty, &format!("value of `{key}`"), false)?;
        if metadata.insert(key.clone(), v).is_some() {
            return Err(GgufError::Duplicate {
                path: path.to_path_buf(),
                what: "metadata key",
                name: key,
            });
        }
    }
    let alignment = match metadata.get("general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some(v) => match v.as_u64() {
            Some(a) if a.is_power_of_two() && a <= MAX_ALIGNMENT => a,
            _ => {
                return Err(GgufError::Alignment {
                    path: path.to_path_buf(),
                    value: v.as_u64().unwrap_or(0),
                })
            }
        },
    } as usize;

    // Tensor infos: (name, dims, type, relative offset).
    let mut raw = Vec::with_capacity((n_tensors as usize).min(c.left() / 24 + 1));
    for i in 0..n_tensors {
        let name = c.string(&format!("tensor {i} name"))?;
        let terr = |problem: TensorProblem| GgufError::Tensor {
            path: path.to_path_buf(),
            tensor: name.clone(),
            problem,
        };
        let n_dims = c.u32(&format!("tensor `{name}` n_dims"))?;
        if !(1..=MAX_DIMS).contains(&n_dims) {
            return Err(terr(TensorProblem::Rank(n_dims)));
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        for d in 0..n_dims {
            let v = c.u64(&format!("tensor `{name}` dim {d}"))?;
            match usize::try_from(v) {
                Ok(v) if v > 0 => dims.push(v),
                _ => return Err(terr(TensorProblem::Dim { dim: d, value: v })),
            }
        }
        let ty_id = c.u32(&format!("tensor `{name}` type"))?;
        let ty = GgmlType::from_id(ty_id).ok_or_else(|| GgufError::TensorType {
            path: path.to_path_buf(),
            tensor: name.clone(),
            ty: ty_id,
        })?;
        let offset = c.u64(&format!("tensor `{name}` offset"))?;
        raw.push((name, dims, ty, offset));
    }
    let data_start = c
        .pos
        .checked_next_multiple_of(alignment)
        .ok_or_else(|| c.truncated("data section", 0))?;

    let mut tensors = Vec::with_capacity(raw.len());
    let mut names = std::collections::HashSet::new();
    for (name, dims, ty, offset) in raw {
        let terr = |problem: TensorProblem| GgufError::Tensor {
            path: path.to_path_buf(),
            tensor: name.clone(),
            problem,
        };
        if !names.insert(name.clone()) {
            return Err(GgufError::Duplicate {
                path: path.to_path_buf(),
                what: "tensor",
                name,
            });
        }
        let numel = dims
            .iter()
            .try_fold(1usize, |a, &d| a.checked_mul(d))
            .ok_or_else(|| terr(TensorProblem::Overflow(dims.clone())))?;
        if !dims[0].is_multiple_of(ty.block_size()) {
            return Err(terr(TensorProblem::Block {
                dim0: dims[0],
                ty,
                block: ty.block_size(),
            }));
        }
        let n_bytes = ty
            .bytes_for(numel)
            .ok_or_else(|| terr(TensorProblem::Overflow(dims.clone())))?;
        if !offset.is_multiple_of(alignment as u64) {
            return Err(terr(TensorProblem::Misaligned { offset, alignment }));
        }
        let start = usize::try_from(offset)
            .ok()
            .and_then(|o| data_start.checked_add(o));
        let end = start.and_then(|s| s.checked_add(n_bytes));
        match (start, end) {
            (Some(start), Some(end)) if end <= bytes.len() => tensors.push(TensorInfo {
                name,
                dims,
                ty,
                start,
                n_bytes,
            }),
            _ => {
                return Err(terr(TensorProblem::OutsideFile {
                    offset,
                    n_bytes,
                    file_len: bytes.len(),
                    data_start,
                }))
            }
        }
    }
    // No two tensors may share bytes.
    let mut order: Vec<&TensorInfo> = tensors.iter().collect();
    order.sort_by_key(|t| t.start);
    for w in order.windows(2) {
        if w[0].start + w[0].n_bytes > w[1].start {
            return Err(GgufError::Overlap {
                path: path.to_path_buf(),
                a: w[0].name.clone(),
                b: w[1].name.clone(),
            });
        }
    }
    Ok(GgufHeader {
        path: path.to_path_buf(),
        version,
        metadata,
        tensors,
        alignment,
        data_start,
    })
}

impl GgufHeader {
    pub fn get(&self, key: &str) -> Result<&Value, GgufError> {
        self.metadata.get(key).ok_or_else(|| GgufError::MissingKey {
            path: self.path.clone(),
            key: key.to_string(),
        })
    }

    fn key_type(&self, key: &str, v: &Value, expected: &'static str) -> GgufError {
        GgufError::KeyType {
            path: self.path.clone(),
            key: key.to_string(),
            found: v.describe(),
            expected,
        }
    }

    pub fn get_u64(&self, key: &str) -> Result<u64, GgufError> {
        let v = self.get(key)?;
        v.as_u64()
            .ok_or_else(|| self.key_type(key, v, "a non-negative integer"))
    }

    pub fn get_f64(&self, key: &str) -> Result<f64, GgufError> {
        let v = self.get(key)?;
        v.as_f64().ok_or_else(|| self.key_type(key, v, "a number"))
    }

    pub fn get_str(&self, key: &str) -> Result<&str, GgufError> {
        match self.get(key)? {
            Value::String(s) => Ok(s),
            v => Err(self.key_type(key, v, "a string")),
        }
    }

    pub fn tensor(&self, name: &str) -> Result<&TensorInfo, GgufError> {
        self.tensors
            .iter()
            .find(|t| t.name == name)
            .ok_or_else(|| GgufError::MissingTensor {
                path: self.path.clone(),
                name: name.to_string(),
            })
    }
}
