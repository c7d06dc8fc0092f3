//! Row-parallel sums in one order, whatever the number of ranks.
//!
//! A row-parallel projection (O and down, see [`crate::split`]) sums over
//! its input columns. Split across P tensor-parallel ranks, each rank sums
//! its own columns and an all-reduce adds the P partial sums. Float
//! addition is not associative, so one process summing all the columns in
//! one run gives other bits than P partial sums added afterwards: a greedy
//! choice between two nearly tied tokens can flip (3 of 8 held-out answers
//! did on SmolLM2's 4-bit weights at P = 3).
//!
//! The fix is to make one process sum the way the ranks do. The input
//! columns are cut into S equal **segments** (S = [`sum_segments`]: the
//! largest tensor-parallel size the model admits), each segment's partial
//! product is computed on its own, and the partials are added in the
//! communicator's order:
//!
//! ```text
//! W (out, in)  = [W_0 | W_1 | … | W_{S−1}]        column segments of in/S
//! x (rows, in) = [x_0 | x_1 | … | x_{S−1}]
//! p_s = x_s · W_sᵀ                                (rows, out), each its own product
//! y[i, j] = ((p_c + p_{c+1}) + p_{c+2}) + …        c = j mod S, indices mod S
//! ```
//!
//! The last line is the order Project 13's all-reduce sums rank partials
//! in (element j starts at rank j mod P; the width `out` is a multiple of
//! P). At P = S each rank's part is exactly one segment, its product the
//! same kernel call on the same numbers, and the all-reduce's sum this
//! fold: tensor parallelism gives one process's bits. At P = 1 the fold
//! runs here ([`Segmented`]). An output's order depends on its column
//! alone, so the sum stays batch-invariant.

use std::sync::Mutex;

use crate::error::ModelError;
use crate::llama::LlamaConfig;
use crate::proj::{LinearWeights, MAX_GROUP};

/// Columns a segment is a whole number of (GGUF's block width), so a
/// segment of quantised weights is whole blocks.
pub const SEGMENT_ALIGN: usize = 32;

/// S for `c`: the largest tensor-parallel size `c` admits (it divides the
/// query heads and the MLP width and fits the K/V heads) whose row-parallel
/// slices are whole 32-column blocks; 1 when only one process fits.
/// SmolLM2-135M: 3 (9 heads, 1,536 MLP columns; 192- and 512-column
/// segments).
pub fn sum_segments(c: &LlamaConfig) -> usize {
    let kv_fits = |d: usize| c.n_kv_head.is_multiple_of(d) || d.is_multiple_of(c.n_kv_head);
    (1..=c.n_head.max(1))
        .rev()
        .find(|&d| {
            c.n_head.is_multiple_of(d)
                && c.intermediate_size.is_multiple_of(d)
                && kv_fits(d)
                && (c.n_head / d * c.head_dim).is_multiple_of(SEGMENT_ALIGN)
                && (c.intermediate_size / d).is_multiple_of(SEGMENT_ALIGN)
        })
        .unwrap_or(1)
}

/// y[i, j] = Σ over s of partials_{(j mod S + t) mod S}[i, j], t = 0, 1,
/// …, left to right. `partials` holds the S partials back to back, each
/// of y's shape (rows, out), so S = partials.len() / y.len() (the
/// callers' scratch, no allocation). The naive reference of the fold is
/// this loop itself.
pub fn fold_segments(partials: &[f32], out: usize, y: &mut [f32]) {
    let len = y.len();
    if len == 0 || out == 0 {
        return;
    }
    let s = partials.len() / len;
    if s == 0 {
        return;
    }
    for (idx, v) in y.iter_mut().enumerate() {
        let c = (idx % out) % s;
        let mut acc = partials[c * len + idx];
        for t in 1..s {
            acc += partials[((c + t) % s) * len + idx];
        }
        *v = acc;
    }
}

/// A row-parallel projection held as S column segments, summed as S
/// tensor-parallel ranks would sum it (module doc). Any weight format:
/// each part is that format's own product over in/S columns.
#[derive(Debug)]
pub struct Segmented {
    parts: Vec<Box<dyn LinearWeights>>,
    format: String,
    /// (rows, in/S) one segment's columns of x; (S, rows, out) the partials
    scratch: Mutex<(Vec<f32>, Vec<f32>)>,
}

impl Segmented {
    /// `parts[s]` is W's columns s·in/S .. (s+1)·in/S: all of one shape.
    pub fn new(parts: Vec<Box<dyn LinearWeights>>) -> Result<Segmented, ModelError> {
        let shape = |p: &dyn LinearWeights| vec![p.out_features(), p.in_features()];
        let Some(first) = parts.first() else {
            return Err(ModelError::Group { got: 0, want: 1 });
        };
        let want = shape(first.as_ref());
        if let Some(p) = parts.iter().find(|p| shape(p.as_ref()) != want) {
            return Err(ModelError::Shape {
                path: Default::default(),
                name: "row-parallel segment".into(),
                expected: want,
                found: shape(p.as_ref()),
            });
        }
        let format = format!("{} ({} segments)", first.format(), parts.len());
        Ok(Segmented {
            parts,
            format,
            scratch: Mutex::new((Vec::new(), Vec::new())),
        })
    }

    pub fn segments(&self) -> usize {
        self.parts.len()
    }
}

impl LinearWeights for Segmented {
    fn out_features(&self) -> usize {
        self.parts[0].out_features()
    }

    fn in_features(&self) -> usize {
        self.parts[0].in_features() * self.parts.len()
    }

    fn apply_into(
        &self,
        x: &[f32],
        rows: usize,
        y: &mut [f32],
        threads: usize,
    ) -> Result<(), ModelError> {
        let (s, w, out) = (
            self.parts.len(),
            self.parts[0].in_features(),
            self.out_features(),
        );
        let inp = w * s;
        if Some(x.len()) != rows.checked_mul(inp) || Some(y.len()) != rows.checked_mul(out) {
            return Err(ModelError::Shape {
                path: Default::default(),
                name: "row-parallel segments' input/output".into(),
                expected: vec![rows * inp, rows * out],
                found: vec![x.len(), y.len()],
            });
        }
        let mut guard = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        let (xs, ps) = &mut *guard;
        ps.resize(s * rows * out, 0.0);
        // The format's fused path, where it has one (the same bits).
        if (2..=MAX_GROUP).contains(&s) {
            let mut others = [self.parts[0].as_ref(); MAX_GROUP - 1];
            for (o, p) in others.iter_mut().zip(&self.parts[1..]) {
                *o = p.as_ref();
            }
            let fused = self.parts[0].apply_segments(&others[..s - 1], x, rows, ps, y, threads);
            if let Some(r) = fused {
                return r;
            }
        }
        // The reference: each segment its own product, then the fold.
        xs.resize(rows * w, 0.0);
        for (k, (part, p)) in self
            .parts
            .iter()
            .zip(ps.chunks_exact_mut(rows * out))
            .enumerate()
        {
            // x_k (rows, in/S): columns k·w .. (k+1)·w of every row.
            for (dst, src) in xs.chunks_exact_mut(w).zip(x.chunks_exact(inp)) {
                dst.copy_from_slice(&src[k * w..][..w]);
            }
            part.apply_into(xs, rows, p, threads)?;
        }
        fold_segments(ps, out, y);
        Ok(())
    }

    fn weight_bytes(&self) -> usize {
        self.parts.iter().map(|p| p.weight_bytes()).sum()
    }

    fn format(&self) -> &str {
        &self.format
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proj::Proj;

    #[test]
    fn smollm2_sums_in_three_segments_and_tiny_models_in_one() {
        let c = LlamaConfig {
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
        };
        assert_eq!(sum_segments(&c), 3);
        // 4 heads of 8: a half is 16 columns, not a whole block.
        let tiny = LlamaConfig {
            n_head: 4,
            n_kv_head: 2,
            head_dim: 8,
            hidden_size: 32,
            intermediate_size: 64,
            ..c
        };
        assert_eq!(sum_segments(&tiny), 1);
        let wide = LlamaConfig {
            head_dim: 64,
            hidden_size: 256,
            intermediate_size: 512,
            ..tiny
        };
        assert_eq!(sum_segments(&wide), 4);
    }

    #[test]
    fn the_fold_starts_each_column_at_its_own_segment() {
        // Values whose sums round differently by order: 1e8 + 1 - 1e8.
        let (a, b, c) = ([1e8f32, 1.0, 1.0], [1.0f32, -1e8, 1.0], [-1e8f32, 1e8, 1e8]);
        let mut y = [0.0f32; 3];
        fold_segments(&[a, b, c].concat(), 3, &mut y);
        // Column 0: (a + b) + c; column 1: (b + c) + a; column 2: (c + a) + b.
        assert_eq!(y[0], (1e8f32 + 1.0) + -1e8);
        assert_eq!(y[1], (-1e8f32 + 1e8) + 1.0);
        assert_eq!(y[2], (1e8f32 + 1.0) + 1.0);
    }

    #[test]
    fn segmented_equals_the_whole_product_within_rounding_and_its_fold_exactly() {
        let (out, inp, rows, s) = (6, 96, 5, 3);
        let w: Vec<f32> = (0..out * inp)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
            .collect();
        let x: Vec<f32> = (0..rows * inp)
            .map(|i| ((i * 13 % 29) as f32 - 14.0) / 3.0)
            .collect();
        let seg = inp / s;
        let part = |k: usize| {
            let cols: Vec<f32> = w
                .chunks_exact(inp)
                .flat_map(|r| r[k * seg..][..seg].to_vec())
                .collect();
            Proj::new(&cols, out, seg).unwrap()
        };
        let parts: Vec<Proj> = (0..s).map(part).collect();
        let sw = Segmented::new((0..s).map(|k| part(k).into_weights()).collect()).unwrap();
        let mut y = vec![0.0f32; rows * out];
        sw.apply_into(&x, rows, &mut y, 1).unwrap();
        // The fold of the parts' own products, as an all-reduce would add them.
        let ps: Vec<Vec<f32>> = (0..s)
            .map(|k| {
                let xk: Vec<f32> = x
                    .chunks_exact(inp)
                    .flat_map(|r| r[k * seg..][..seg].to_vec())
                    .collect();
                parts[k].apply(&xk, rows, 1).unwrap()
            })
            .collect();
        let mut want = vec![0.0f32; rows * out];
        fold_segments(&ps.concat(), out, &mut want);
        assert_eq!(y, want);
        let whole = Proj::new(&w, out, inp).unwrap().apply(&x, rows, 1).unwrap();
        for (a, b) in y.iter().zip(&whole) {
            assert!((a - b).abs() <= 1e-3 * b.abs().max(1.0), "{a} vs {b}");
        }
        // One row's output does not depend on the rows beside it.
        let mut one = vec![0.0f32; out];
        sw.apply_into(&x[2 * inp..3 * inp], 1, &mut one, 1).unwrap();
        assert_eq!(one, y[2 * out..3 * out]);
    }
}
