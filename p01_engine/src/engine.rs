//! The engine: load a graph + weights once, then run batches through it.
//!
//! `forward` is the narrative: for each step, in file order, read its inputs
//! (the batch input or earlier steps' buffers) and write its own buffer.
//! Buffers live in a [`Workspace`] that grows to the largest batch seen, so
//! after one warm-up call `forward_into` allocates nothing.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::Tensor;

use crate::error::GraphError;
use crate::graph::{compile, CompileOptions, Plan, Slot, Step};
use crate::linear::Activation;
use crate::ops;

/// How to load a model directory.
#[derive(Clone, Copy, Debug)]
pub struct LoadOptions {
    /// Memory-map `weights.safetensors` instead of reading it into a buffer.
    pub mmap: bool,
    pub compile: CompileOptions,
    /// Threads a matmul may use (1 = never leave the calling thread).
    pub threads: usize,
}

impl Default for LoadOptions {
    fn default() -> Self {
        Self {
            mmap: true,
            compile: CompileOptions::default(),
            threads: rayon::current_num_threads(),
        }
    }
}

/// Facts derived from the loaded graph.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ModelStats {
    pub n_params: usize,
    /// f32 parameters: 4 bytes each.
    pub weight_bytes: usize,
    /// Linear-layer FLOPs per example: 2 per multiply-add plus one per bias
    /// add. Elementwise ops are counted separately.
    pub linear_flops_per_example: usize,
    /// One FLOP per element for relu/add, ~10 for gelu/layernorm/softmax rows
    /// (an estimate; they are bandwidth-bound).
    pub other_flops_per_example: usize,
}

/// A loaded model: the compiled graph of `model.json` with its packed
/// weights, ready to run (named `Graph`, not `Engine`: the request-level
/// `Engine` seam of the servers is another concept).
#[derive(Debug)]
pub struct Graph {
    plan: Plan,
    threads: usize,
    pub dir: PathBuf,
    /// How long reading/mapping + decoding + packing took.
    pub load_time: Duration,
}

/// Reusable activation buffers: one per step, each (batch x per-example numel).
#[derive(Debug, Default)]
pub struct Workspace {
    bufs: Vec<Vec<f32>>,
}

impl Graph {
    /// Load `dir/model.json` and `dir/weights.safetensors` with default options.
    pub fn load(dir: impl AsRef<Path>) -> Result<Graph, GraphError> {
        Self::load_with(dir, LoadOptions::default())
    }

    pub fn load_with(dir: impl AsRef<Path>, opts: LoadOptions) -> Result<Graph, GraphError> {
        let t0 = Instant::now();
        let dir = dir.as_ref();
        let graph_path = dir.join("model.json");
        let weights_path = dir.join("weights.safetensors");
        let json = std::fs::read_to_string(&graph_path).map_err(|source| GraphError::Io {
            path: graph_path.clone(),
            source,
        })?;
        let io_err = |source| GraphError::Io {
            path: weights_path.clone(),
            source,
        };
        let weights = if opts.mmap {
            let file = std::fs::File::open(&weights_path).map_err(io_err)?;
            // SAFETY: the map is read-only and dropped before this function
            // returns; the weights are copied (packed) out of it. A concurrent
            // truncation of the file by another process could fault, as with
            // any mmap-based loader (llama.cpp, safetensors' own).
            let map = unsafe { memmap2::Mmap::map(&file) }.map_err(io_err)?;
            common::st::parse(&map, &weights_path)?
        } else {
            let bytes = std::fs::read(&weights_path).map_err(io_err)?;
            common::st::parse(&bytes, &weights_path)?
        };
        let plan = compile(&json, &graph_path, &weights, opts.compile)?;
        Ok(Graph {
            plan,
            threads: opts.threads.max(1),
            dir: dir.to_path_buf(),
            load_time: t0.elapsed(),
        })
    }

    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// Per-example input shape.
    pub fn input_shape(&self) -> &[usize] {
        &self.plan.input_shape
    }

    /// Per-example output shape.
    pub fn output_shape(&self) -> &[usize] {
        &self.plan.output_shape
    }

    pub fn stats(&self) -> ModelStats {
        let mut linear = 0usize;
        let mut other = 0usize;
        for n in &self.plan.nodes {
            let out: usize = n.out_shape.iter().product();
            let rows_per_example: usize = n.in_shape.iter().rev().skip(1).product();
            match &n.step {
                Step::Linear { lin, act } => {
                    linear += rows_per_example * (2 * lin.macs_per_row() + lin.out_features);
                    if *act == Activation::Relu {
                        other += out;
                    }
                }
                Step::Relu | Step::Add => other += out,
                Step::Gelu(_) | Step::LayerNorm { .. } | Step::Softmax => other += 10 * out,
                Step::Embedding { .. } => {}
            }
        }
        ModelStats {
            n_params: self.plan.n_params,
            weight_bytes: self.plan.n_params * 4,
            linear_flops_per_example: linear,
            other_flops_per_example: other,
        }
    }

    /// Run a batch: `input` is (batch, input_shape...). Allocates its buffers;
    /// use [`Graph::forward_into`] in loops.
    pub fn forward(&self, input: &Tensor) -> Result<Tensor, GraphError> {
        let mut ws = Workspace::default();
        let batch = self.check_input(input.shape())?;
        let out = self.forward_into(&mut ws, input.data(), batch)?;
        let mut shape = vec![batch];
        shape.extend_from_slice(&self.plan.output_shape);
        Ok(Tensor::new(shape, out.to_vec()).expect("output buffer sized from its shape"))
    }

    /// Check an input shape against (batch, input_shape...) and return batch.
    pub fn check_input(&self, shape: &[usize]) -> Result<usize, GraphError> {
        match shape.split_first() {
            Some((&b, rest)) if rest == self.plan.input_shape.as_slice() => Ok(b),
            _ => Err(GraphError::Input {
                expected: self.plan.input_shape.clone(),
                found: shape.to_vec(),
            }),
        }
    }

    /// The forward pass over a flat (batch, input_shape...) buffer, writing
    /// into `ws`; returns the output rows. No heap allocation once `ws` has
    /// seen a batch this large (and `threads` is 1: rayon's queues may allocate).
    pub fn forward_into<'w>(
        &self,
        ws: &'w mut Workspace,
        input: &[f32],
        batch: usize,
    ) -> Result<&'w [f32], GraphError> {
        let per_example: usize = self.plan.input_shape.iter().product();
        if Some(input.len()) != batch.checked_mul(per_example) {
            return Err(GraphError::Input {
                expected: self.plan.input_shape.clone(),
                found: vec![batch, input.len() / per_example.max(1)],
            });
        }
        ws.bufs.resize_with(self.plan.n_bufs, Vec::new);
        for node in &self.plan.nodes {
            // Take this step's buffer out so the inputs can be borrowed beside it.
            let mut y = std::mem::take(&mut ws.bufs[node.output]);
            y.resize(batch * node.out_shape.iter().product::<usize>(), 0.0);
            let read = |s: Slot| -> &[f32] {
                match s {
                    Slot::Input => input,
                    Slot::Buf(i) => &ws.bufs[i],
                }
            };
            let x = read(node.inputs[0]);
            let width = node.in_shape.last().copied().unwrap_or(1);
            match &node.step {
                // y = x W^T + b (optionally relu'd in the same pass)
                Step::Linear { lin, act } => lin.forward(
                    x,
                    x.len() / lin.in_features.max(1),
                    &mut y,
                    *act,
                    self.threads,
                ),
                Step::Relu => {
                    y.copy_from_slice(x);
                    ops::relu_inplace(&mut y);
                }
                Step::Gelu(a) => {
                    y.copy_from_slice(x);
                    ops::gelu_inplace(&mut y, *a);
                }
                Step::LayerNorm { weight, bias, eps } => {
                    ops::layernorm_rows(x, width, weight, bias, *eps, &mut y)
                }
                Step::Softmax => {
                    y.copy_from_slice(x);
                    ops::softmax_rows_inplace(&mut y, width);
                }
                Step::Embedding { table, dim } => {
                    if let Err(source) = ops::embedding_rows(x, table, *dim, &mut y) {
                        ws.bufs[node.output] = y;
                        return Err(GraphError::Op {
                            node: node.label.clone(),
                            source,
                        });
                    }
                }
                Step::Add => ops::add_into(x, read(node.inputs[1]), &mut y),
            }
            ws.bufs[node.output] = y;
        }
        Ok(&ws.bufs[self.plan.output])
    }
}
