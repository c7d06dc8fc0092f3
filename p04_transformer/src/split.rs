//! What part of each weight a process keeps.
//!
//! One process keeps every weight whole ([`Split::whole`]). Under tensor
//! parallelism (Project 13; Megatron-LM's split) rank r of P keeps a slice
//! of every projection, so that the layer's work and its weights divide by
//! P and two all-reduces per layer put the pieces back together:
//!
//! ```text
//! W (out, in)      column-parallel: rank r keeps rows  r·out/P .. (r+1)·out/P
//!                  (Q, K, V by whole heads; gate and up by MLP columns)
//!                  row-parallel:    rank r keeps cols  r·in/P  .. (r+1)·in/P
//!                  (O and down: each rank's output is a partial sum)
//! ```
//!
//! The LM head is kept whole on every rank (replicated) or split by
//! vocabulary rows (vocab-parallel, its logits gathered). The embedding
//! table and the norms are always whole.
//!
//! Under pipeline parallelism stage s of S keeps only its run of layers,
//! L/S of them (GPipe); the embedding table lives on the first stage, the
//! final norm and the LM head on the last.

use std::ops::Range;

use thiserror::Error;

use crate::llama::LlamaConfig;

/// The LM head's part under tensor parallelism.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HeadSplit {
    /// Every rank keeps the whole head (vocab, hidden).
    Replicated,
    /// Rank r keeps vocabulary rows r·V/P .. (r+1)·V/P.
    VocabParallel,
}

/// Rank `rank` of `size` tensor-parallel ranks, in pipeline stage
/// `stage` of `stages`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Split {
    pub rank: usize,
    pub size: usize,
    pub head: HeadSplit,
    pub stage: usize,
    pub stages: usize,
}

/// A projection of a Llama block, or the LM head.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    Q,
    K,
    V,
    O,
    Gate,
    Up,
    Down,
    Head,
}

/// A degree of parallelism that does not divide the model.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
pub enum SplitError {
    #[error("tensor-parallel rank {rank} of {size}: the rank must be below the size, and the size at least 1")]
    Rank { rank: usize, size: usize },
    #[error("pipeline stage {stage} of {stages}: the stage must be below the count, and the count at least 1")]
    Stage { stage: usize, stages: usize },
    #[error(
        "{stages} pipeline stages do not divide the {layers} layers; counts that do: {divisors:?}"
    )]
    Layers {
        stages: usize,
        layers: usize,
        divisors: Vec<usize>,
    },
    #[error("tensor parallelism {size} does not divide {what} ({count}); the sizes that divide all of this model's are {divisors:?}")]
    Indivisible {
        size: usize,
        what: &'static str,
        count: usize,
        divisors: Vec<usize>,
    },
}

/// The rows and columns of a weight W (out, in) this process keeps.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Keep {
    /// For each kept row, the row of the stored tensor it comes from, in
    /// order (a file may store rows permuted: GGUF's Q and K); `None` keeps
    /// every row in stored order.
    pub rows: Option<Vec<usize>>,
    /// The input columns kept.
    pub cols: Range<usize>,
    /// The stored tensor's (out, in).
    pub full: [usize; 2],
    /// Row-parallel weights: the kept columns are summed as this many
    /// equal segments, folded in the all-reduce's order
    /// ([`crate::segments`]); 1 for every other weight and for a rank whose
    /// part is one segment.
    pub segments: usize,
}

impl Keep {
    /// All of a tensor (out, in), rows in `rows`' order if given.
    pub fn whole(full: [usize; 2], rows: Option<Vec<usize>>) -> Keep {
        Keep {
            rows,
            cols: 0..full[1],
            full,
            segments: 1,
        }
    }

    /// Segment `s` of [`Keep::segments`]: the same rows, columns
    /// s·w .. (s+1)·w of the kept ones (w = kept columns / segments), one
    /// segment.
    pub fn segment(&self, s: usize) -> Keep {
        let w = self.cols.len() / self.segments.max(1);
        let start = self.cols.start + s * w;
        Keep {
            rows: self.rows.clone(),
            cols: start..start + w,
            full: self.full,
            segments: 1,
        }
    }

    /// (out, in) of the part kept.
    pub fn shape(&self) -> [usize; 2] {
        let out = self.rows.as_ref().map_or(self.full[0], Vec::len);
        [out, self.cols.len()]
    }

    /// Whether this keeps the stored tensor as it is.
    pub fn is_whole(&self) -> bool {
        self.rows.is_none() && self.cols == (0..self.full[1])
    }

    /// The kept part of `w` (out, in), row-major (rows gathered, columns
    /// sliced). `None` if `w` is not (out, in) or a row or column lies
    /// outside it.
    pub fn take(&self, w: &[f32]) -> Option<Vec<f32>> {
        let [out, inp] = self.full;
        if out.checked_mul(inp)? != w.len()
            || self.cols.end > inp
            || self.cols.start > self.cols.end
        {
            return None;
        }
        let all: Vec<usize>;
        let rows = match &self.rows {
            Some(r) => r.as_slice(),
            None => {
                all = (0..out).collect();
                &all
            }
        };
        let mut kept = Vec::with_capacity(rows.len().checked_mul(self.cols.len())?);
        for &r in rows {
            if r >= out {
                return None;
            }
            kept.extend_from_slice(&w[r * inp..][self.cols.clone()]);
        }
        Some(kept)
    }
}

/// Part `rank` of `count` items split into `size` equal parts.
fn part(count: usize, rank: usize, size: usize) -> Range<usize> {
    let each = count / size;
    rank * each..(rank + 1) * each
}

impl Split {
    /// One process: every weight whole.
    pub const fn whole() -> Split {
        Split {
            rank: 0,
            size: 1,
            head: HeadSplit::Replicated,
            stage: 0,
            stages: 1,
        }
    }

    pub fn new(rank: usize, size: usize, head: HeadSplit) -> Result<Split, SplitError> {
        if size == 0 || rank >= size {
            return Err(SplitError::Rank { rank, size });
        }
        Ok(Split {
            rank,
            size,
            head,
            ..Split::whole()
        })
    }

    /// Pipeline stage `stage` of `stages` (every weight of its layers whole).
    pub fn stage(stage: usize, stages: usize) -> Result<Split, SplitError> {
        if stages == 0 || stage >= stages {
            return Err(SplitError::Stage { stage, stages });
        }
        Ok(Split {
            stage,
            stages,
            ..Split::whole()
        })
    }

    pub fn is_whole(&self) -> bool {
        self.size == 1 && self.stages == 1
    }

    /// The layers this stage keeps, of `n_layer` (checked to divide).
    pub fn layers(&self, n_layer: usize) -> Range<usize> {
        part(n_layer, self.stage, self.stages.max(1))
    }

    pub fn is_first_stage(&self) -> bool {
        self.stage == 0
    }

    pub fn is_last_stage(&self) -> bool {
        self.stage + 1 == self.stages.max(1)
    }

    /// The K/V heads this rank keeps. A share of them when the size
    /// divides them; when the ranks outnumber the K/V heads (and their
    /// count divides the size) one each, every K/V head kept by size /
    /// n_kv_head ranks: those whose query heads read it (vLLM's rule). The
    /// tiny Llama's 2 K/V heads at TP = 4: ranks 0 and 1 keep head 0.
    pub fn kv_heads(&self, n_kv_head: usize) -> Range<usize> {
        let p = self.size.max(1);
        if p > n_kv_head {
            let h = self.rank * n_kv_head / p;
            h..h + 1
        } else {
            part(n_kv_head, self.rank, p)
        }
    }

    /// Whether `size` ranks can share `n_kv_head` K/V heads: a share each
    /// or a replicated head each.
    fn kv_fits(size: usize, n_kv_head: usize) -> bool {
        n_kv_head.is_multiple_of(size) || size.is_multiple_of(n_kv_head)
    }

    /// The counts this split must divide: query heads, the MLP width, and
    /// the vocabulary when the head is vocab-parallel (the K/V heads are
    /// divided or replicated: [`Split::kv_heads`]).
    fn counts(&self, c: &LlamaConfig) -> Vec<(&'static str, usize)> {
        let mut counts = vec![
            ("the query heads", c.n_head),
            ("the MLP width", c.intermediate_size),
        ];
        if self.head == HeadSplit::VocabParallel {
            counts.push(("the vocabulary", c.vocab_size));
        }
        counts
    }

    /// Refuse a size that does not divide the model, naming the numbers
    /// and the sizes that would.
    pub fn check(&self, c: &LlamaConfig) -> Result<(), SplitError> {
        if !c.n_layer.is_multiple_of(self.stages.max(1)) {
            return Err(SplitError::Layers {
                stages: self.stages,
                layers: c.n_layer,
                divisors: (1..=c.n_layer)
                    .filter(|d| c.n_layer.is_multiple_of(*d))
                    .collect(),
            });
        }
        let counts = self.counts(c);
        let kv = ("the K/V heads", c.n_kv_head);
        let failed = match counts.iter().find(|(_, n)| !n.is_multiple_of(self.size)) {
            Some(&f) => f,
            None if !Split::kv_fits(self.size, c.n_kv_head) => kv,
            None => return Ok(()),
        };
        let (what, count) = failed;
        let smallest = counts.iter().map(|&(_, n)| n).min().unwrap_or(1);
        let divisors = (1..=smallest)
            .filter(|&d| {
                counts.iter().all(|&(_, n)| n.is_multiple_of(d)) && Split::kv_fits(d, c.n_kv_head)
            })
            .collect();
        Err(SplitError::Indivisible {
            size: self.size,
            what,
            count,
            divisors,
        })
    }

    /// What this rank keeps of `role`'s weight, stored as (out, in) with
    /// `stored_rows` mapping each row in model order to its stored row
    /// (None: stored in model order). The split must have passed
    /// [`Split::check`].
    pub fn keep(
        &self,
        role: Role,
        c: &LlamaConfig,
        full: [usize; 2],
        stored_rows: Option<Vec<usize>>,
    ) -> Keep {
        let (r, p) = (self.rank, self.size);
        let by_rows = |range: Range<usize>| {
            let rows = match &stored_rows {
                Some(src) => src[range].to_vec(),
                None => range.collect(),
            };
            Keep {
                rows: Some(rows),
                cols: 0..full[1],
                full,
                segments: 1,
            }
        };
        // Row-parallel sums in S segments on every rank count: S/P each
        // (one at P = S), or 1 where P does not divide S (then the sums are
        // not one process's; see `crate::segments`).
        let s = crate::segments::sum_segments(c);
        let segments = if s.is_multiple_of(p) { s / p } else { 1 };
        if p == 1 {
            let mut k = Keep::whole(full, stored_rows);
            if matches!(role, Role::O | Role::Down) {
                k.segments = segments;
            }
            return k;
        }
        let hd = c.head_dim;
        match role {
            // Whole heads: the rows of heads r·H/P .. (r+1)·H/P.
            Role::Q => {
                let h = part(c.n_head, r, p);
                by_rows(h.start * hd..h.end * hd)
            }
            Role::K | Role::V => {
                let h = self.kv_heads(c.n_kv_head);
                by_rows(h.start * hd..h.end * hd)
            }
            Role::Gate | Role::Up => by_rows(part(c.intermediate_size, r, p)),
            Role::O => {
                let h = part(c.n_head, r, p);
                Keep {
                    rows: stored_rows,
                    cols: h.start * hd..h.end * hd,
                    full,
                    segments,
                }
            }
            Role::Down => Keep {
                rows: stored_rows,
                cols: part(c.intermediate_size, r, p),
                full,
                segments,
            },
            Role::Head => match self.head {
                HeadSplit::Replicated => Keep::whole(full, stored_rows),
                HeadSplit::VocabParallel => by_rows(part(c.vocab_size, r, p)),
            },
        }
    }
}

impl Default for Split {
    fn default() -> Split {
        Split::whole()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn smollm2() -> LlamaConfig {
        LlamaConfig {
            vocab_size: 49152,
            hidden_size: 576,
            n_layer: 30,
            n_head: 9,
            n_kv_head: 3,
            head_dim: 64,
            intermediate_size: 1536,
            rope_theta: 1e5,
            rms_norm_eps: 1e-5,
            max_seq: 8192,
        }
    }

    #[test]
    fn two_ranks_do_not_divide_smollm2_and_the_error_names_the_numbers() {
        let e = Split::new(0, 2, HeadSplit::Replicated)
            .unwrap()
            .check(&smollm2())
            .unwrap_err();
        assert_eq!(
            e,
            SplitError::Indivisible {
                size: 2,
                what: "the query heads",
                count: 9,
                divisors: vec![1, 3],
            }
        );
        assert!(Split::new(2, 3, HeadSplit::VocabParallel)
            .unwrap()
            .check(&smollm2())
            .is_ok());
        assert!(Split::new(3, 3, HeadSplit::Replicated).is_err());
    }

    #[test]
    fn column_and_row_parallel_parts_tile_the_weight() {
        let c = smollm2();
        let mut q_rows = Vec::new();
        let mut down_cols = Vec::new();
        for r in 0..3 {
            let s = Split::new(r, 3, HeadSplit::Replicated).unwrap();
            let q = s.keep(Role::Q, &c, [576, 576], None);
            assert_eq!(q.shape(), [192, 576]);
            q_rows.extend(q.rows.unwrap());
            let d = s.keep(Role::Down, &c, [576, 1536], None);
            assert_eq!(d.shape(), [576, 512]);
            down_cols.extend(d.cols);
            assert_eq!(s.keep(Role::K, &c, [192, 576], None).shape(), [64, 576]);
            assert!(s.keep(Role::Head, &c, [49152, 576], None).is_whole());
        }
        assert_eq!(q_rows, (0..576).collect::<Vec<_>>());
        assert_eq!(down_cols, (0..1536).collect::<Vec<_>>());
    }

    #[test]
    fn ranks_beyond_the_kv_heads_replicate_them() {
        // 4 query heads, 2 K/V heads: TP = 4 gives each rank one query
        // head and the K/V head its query head reads.
        let c = LlamaConfig {
            n_head: 4,
            n_kv_head: 2,
            head_dim: 8,
            hidden_size: 32,
            intermediate_size: 64,
            ..smollm2()
        };
        let kv: Vec<_> = (0..4)
            .map(|r| {
                let s = Split::new(r, 4, HeadSplit::Replicated).unwrap();
                s.check(&c).unwrap();
                s.kv_heads(c.n_kv_head)
            })
            .collect();
        assert_eq!(kv, vec![0..1, 0..1, 1..2, 1..2]);
        // Query head r reads K/V head r / (4 / 2): the same.
        assert_eq!(
            Split::new(3, 4, HeadSplit::Replicated)
                .unwrap()
                .keep(Role::K, &c, [16, 32], None)
                .rows,
            Some((8..16).collect())
        );
        // 3 K/V heads and 6 ranks would replicate; 2 ranks neither divide
        // nor replicate them.
        let c6 = LlamaConfig {
            n_head: 6,
            n_kv_head: 3,
            intermediate_size: 60,
            ..c
        };
        assert!(Split::new(0, 6, HeadSplit::Replicated)
            .unwrap()
            .check(&c6)
            .is_ok());
        let e = Split::new(0, 2, HeadSplit::Replicated)
            .unwrap()
            .check(&c6)
            .unwrap_err();
        assert_eq!(
            e,
            SplitError::Indivisible {
                size: 2,
                what: "the K/V heads",
                count: 3,
                divisors: vec![1, 3, 6],
            }
        );
    }

    #[test]
    fn take_gathers_rows_and_slices_columns() {
        // w (3, 4) = 0..12
        let w: Vec<f32> = (0..12).map(|v| v as f32).collect();
        let k = Keep {
            rows: Some(vec![2, 0]),
            cols: 1..3,
            full: [3, 4],
            segments: 1,
        };
        assert_eq!(k.take(&w), Some(vec![9.0, 10.0, 1.0, 2.0]));
        assert_eq!(k.take(&w[..11]), None);
        let bad = Keep {
            rows: Some(vec![3]),
            ..k
        };
        assert_eq!(bad.take(&w), None);
    }
}
