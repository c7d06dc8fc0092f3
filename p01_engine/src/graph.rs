//! `model.json`: an ordered list of `{op, inputs, params, output}` nodes over
//! one input, checked completely at load and compiled into a [`Plan`].
//!
//! ```json
//! { "format": "inference-lab/p01-graph/v1",
//!   "input": {"name": "x", "shape": [784]},          // per example; batch is leading
//!   "nodes": [{"op": "linear", "inputs": ["x"], "params": {"weight": "fc1.weight", "bias": "fc1.bias"}, "output": "h1"},
//!             {"op": "relu", "inputs": ["h1"], "params": {}, "output": "a1"}, ...],
//!   "output": "logits" }
//! ```
//! Ops and params: `linear {weight, bias?}`, `relu {}`, `gelu {approximate: "none"|"tanh"}`,
//! `layernorm {weight, bias, eps}`, `softmax {dim: -1}`, `embedding {weight}`, `add {}` (two inputs).

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use common::st::StFile;
use serde::Deserialize;
use serde_json::Value;

use crate::error::GraphError;
use crate::linear::{Activation, Linear};
use crate::ops::GeluApprox;

/// Caps on what a model file may claim (hostile-file hygiene).
const MAX_NODES: usize = 100_000;
const MAX_RANK: usize = 8;
const MAX_EXAMPLE_NUMEL: usize = 1 << 28;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct GraphFile {
    #[serde(default)]
    format: Option<String>,
    input: InputSpec,
    nodes: Vec<NodeSpec>,
    output: String,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct InputSpec {
    name: String,
    shape: Vec<usize>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct NodeSpec {
    op: String,
    inputs: Vec<String>,
    #[serde(default)]
    params: serde_json::Map<String, Value>,
    output: String,
}

/// Where a step reads a value from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Slot {
    /// The graph input.
    Input,
    /// The output buffer of an earlier step.
    Buf(usize),
}

/// One executable op with its weights, already shaped and packed.
#[derive(Debug)]
pub enum Step {
    Linear {
        lin: Linear,
        act: Activation,
    },
    Relu,
    Gelu(GeluApprox),
    LayerNorm {
        /// (width)
        weight: Vec<f32>,
        /// (width)
        bias: Vec<f32>,
        eps: f32,
    },
    Softmax,
    Embedding {
        /// (vocab, dim)
        table: Vec<f32>,
        dim: usize,
    },
    Add,
}

/// A step with its wiring and per-example output shape.
#[derive(Debug)]
pub struct PlanNode {
    /// "node 2 (linear -> h2)", for errors.
    pub label: String,
    pub step: Step,
    pub inputs: Vec<Slot>,
    /// Index of the buffer this step writes.
    pub output: usize,
    /// Per-example shape of the input (first input).
    pub in_shape: Vec<usize>,
    /// Per-example shape of the output.
    pub out_shape: Vec<usize>,
}

/// A validated, compiled graph.
#[derive(Debug)]
pub struct Plan {
    pub input_name: String,
    /// Per-example input shape (the batch dimension is leading and free).
    pub input_shape: Vec<usize>,
    pub nodes: Vec<PlanNode>,
    /// Buffer holding the graph output.
    pub output: usize,
    pub output_shape: Vec<usize>,
    /// Number of buffers (one per unfused node).
    pub n_bufs: usize,
    /// Parameters referenced by the graph (each tensor counted once).
    pub n_params: usize,
}

/// Compile options.
#[derive(Clone, Copy, Debug)]
pub struct CompileOptions {
    /// Fold a `relu` into the `linear` that feeds it (when nothing else reads
    /// the linear's output).
    pub fuse_linear_relu: bool,
}

impl Default for CompileOptions {
    fn default() -> Self {
        Self {
            fuse_linear_relu: true,
        }
    }
}

fn numel(shape: &[usize]) -> Option<usize> {
    common::tensor::checked_numel(shape).filter(|&n| n <= MAX_EXAMPLE_NUMEL)
}

/// Parse `model.json` text and check it against the weights; `path` names the
/// file in errors.
pub fn compile(
    json: &str,
    path: &Path,
    weights: &StFile,
    opts: CompileOptions,
) -> Result<Plan, GraphError> {
    let g: GraphFile = serde_json::from_str(json).map_err(|source| GraphError::Json {
        path: path.to_path_buf(),
        source,
    })?;
    let graph_err = |msg: String| GraphError::Graph {
        path: path.to_path_buf(),
        msg,
    };
    if let Some(f) = &g.format {
        if f != "inference-lab/p01-graph/v1" {
            return Err(graph_err(format!(
                "format is `{f}`, expected `inference-lab/p01-graph/v1`"
            )));
        }
    }
    if g.nodes.is_empty() || g.nodes.len() > MAX_NODES {
        return Err(graph_err(format!(
            "has {} nodes, expected 1..={MAX_NODES}",
            g.nodes.len()
        )));
    }
    if g.input.shape.len() > MAX_RANK
        || numel(&g.input.shape).is_none()
        || g.input.shape.contains(&0)
    {
        return Err(graph_err(format!(
            "input `{}` shape {:?}: rank must be <= {MAX_RANK}, every dimension >= 1 and at most {MAX_EXAMPLE_NUMEL} elements",
            g.input.name, g.input.shape
        )));
    }

    // Which values each node's output feeds, to decide fusion.
    let mut readers: HashMap<&str, usize> = HashMap::new();
    for n in &g.nodes {
        for i in &n.inputs {
            *readers.entry(i.as_str()).or_default() += 1;
        }
    }

    let mut values: HashMap<String, (Slot, Vec<usize>)> = HashMap::new();
    values.insert(g.input.name.clone(), (Slot::Input, g.input.shape.clone()));
    let mut used_params: BTreeMap<String, usize> = BTreeMap::new();
    let mut nodes: Vec<PlanNode> = Vec::with_capacity(g.nodes.len());
    let mut n_bufs = 0usize;

    for (idx, spec) in g.nodes.iter().enumerate() {
        let label = format!("node {idx} ({} -> {})", spec.op, spec.output);
        let ctx = NodeCtx {
            path,
            label: &label,
            spec,
            weights,
        };
        if values.contains_key(&spec.output) {
            return Err(ctx.err(format!(
                "output `{}` is already defined earlier",
                spec.output
            )));
        }
        let mut ins = Vec::with_capacity(spec.inputs.len());
        for name in &spec.inputs {
            let (slot, shape) = values.get(name).ok_or_else(|| {
                ctx.err(format!(
                    "input `{name}` is not the graph input or an earlier node's output"
                ))
            })?;
            ins.push((*slot, shape.clone()));
        }
        let arity = if spec.op == "add" { 2 } else { 1 };
        if ins.len() != arity {
            return Err(ctx.err(format!("takes {arity} input(s), found {}", ins.len())));
        }
        let in_shape = ins[0].1.clone();
        let (step, out_shape) = ctx.build_step(&in_shape, &ins, &mut used_params)?;
        let _ = numel(&out_shape)
            .ok_or_else(|| ctx.err(format!("output shape {out_shape:?} is too large")))?;

        // linear -> relu fusion: the relu reuses the linear's buffer.
        if opts.fuse_linear_relu && matches!(step, Step::Relu) {
            if let (Some(prev), Slot::Buf(b)) = (nodes.last_mut(), ins[0].0) {
                let prev_spec = &g.nodes[idx - 1];
                let only_reader = readers.get(prev_spec.output.as_str()) == Some(&1);
                if let Step::Linear { act, .. } = &mut prev.step {
                    if prev.output == b
                        && only_reader
                        && *act == Activation::None
                        && prev_spec.output != g.output
                    {
                        *act = Activation::Relu;
                        prev.label = format!("{} + {label}", prev.label);
                        values.insert(spec.output.clone(), (Slot::Buf(b), out_shape));
                        continue;
                    }
                }
            }
        }
        let out = n_bufs;
        n_bufs += 1;
        values.insert(spec.output.clone(), (Slot::Buf(out), out_shape.clone()));
        nodes.push(PlanNode {
            label,
            step,
            inputs: ins.iter().map(|(s, _)| *s).collect(),
            output: out,
            in_shape,
            out_shape,
        });
    }

    let (slot, output_shape) = values
        .get(&g.output)
        .ok_or_else(|| graph_err(format!("output `{}` is not produced by any node", g.output)))?;
    let Slot::Buf(output) = *slot else {
        return Err(graph_err(format!(
            "output `{}` is the graph input; no node computes it",
            g.output
        )));
    };
    Ok(Plan {
        input_name: g.input.name,
        input_shape: g.input.shape,
        nodes,
        output,
        output_shape: output_shape.clone(),
        n_bufs,
        n_params: used_params.values().sum(),
    })
}

struct NodeCtx<'a> {
    path: &'a Path,
    label: &'a str,
    spec: &'a NodeSpec,
    weights: &'a StFile,
}

impl NodeCtx<'_> {
    fn err(&self, msg: String) -> GraphError {
        GraphError::Node {
            path: PathBuf::from(self.path),
            node: self.label.to_string(),
            msg,
        }
    }

    fn check_params(&self, allowed: &[&str]) -> Result<(), GraphError> {
        for k in self.spec.params.keys() {
            if !allowed.contains(&k.as_str()) {
                return Err(self.err(format!("unknown param `{k}`; allowed: {allowed:?}")));
            }
        }
        Ok(())
    }

    fn param_str(&self, key: &str) -> Result<Option<&str>, GraphError> {
        match self.spec.params.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(v) => Err(self.err(format!("param `{key}` must be a string, found {v}"))),
        }
    }

    /// The weight tensor named by param `key`, with an exact expected shape
    /// (`None` entries match anything).
    fn tensor(
        &self,
        key: &str,
        expected: &[Option<usize>],
        used: &mut BTreeMap<String, usize>,
    ) -> Result<&common::Tensor, GraphError> {
        let name = self
            .param_str(key)?
            .ok_or_else(|| self.err(format!("missing param `{key}` (a tensor name)")))?;
        let t = self.weights.tensors.get(name).ok_or_else(|| {
            self.err(format!(
                "param `{key}` names tensor `{name}`, which is not in {}",
                self.weights.path.display()
            ))
        })?;
        let ok = t.shape().len() == expected.len()
            && t.shape()
                .iter()
                .zip(expected)
                .all(|(&d, e)| e.is_none_or(|e| e == d));
        if !ok {
            let exp: Vec<String> = expected
                .iter()
                .map(|e| e.map_or("_".into(), |d| d.to_string()))
                .collect();
            return Err(self.err(format!(
                "tensor `{name}` ({key}) has shape {:?}, expected [{}]",
                t.shape(),
                exp.join(", ")
            )));
        }
        used.insert(name.to_string(), t.numel());
        Ok(t)
    }

    fn build_step(
        &self,
        in_shape: &[usize],
        ins: &[(Slot, Vec<usize>)],
        used: &mut BTreeMap<String, usize>,
    ) -> Result<(Step, Vec<usize>), GraphError> {
        let width = in_shape.last().copied();
        let need_width = || {
            width.ok_or_else(|| {
                self.err(format!(
                    "input has shape {in_shape:?}; this op needs a last dimension"
                ))
            })
        };
        let same = || in_shape.to_vec();
        Ok(match self.spec.op.as_str() {
            "linear" => {
                self.check_params(&["weight", "bias"])?;
                let in_f = need_width()?;
                let w = self.tensor("weight", &[None, Some(in_f)], used)?;
                let out_f = w.shape()[0];
                if out_f == 0 {
                    // A zero-width output would reach ops that split rows by width.
                    return Err(self.err("weight has 0 output features".to_string()));
                }
                let b = match self.param_str("bias")? {
                    Some(_) => Some(self.tensor("bias", &[Some(out_f)], used)?.data()),
                    None => None,
                };
                let mut out = in_shape.to_vec();
                *out.last_mut().expect("width checked") = out_f;
                let lin = Linear::new(w.data(), b, out_f, in_f);
                (Step::Linear { lin, act: Activation::None }, out)
            }
            "relu" => {
                self.check_params(&[])?;
                (Step::Relu, same())
            }
            "gelu" => {
                self.check_params(&["approximate"])?;
                let a = match self.param_str("approximate")? {
                    None | Some("none") => GeluApprox::Erf,
                    Some("tanh") => GeluApprox::Tanh,
                    Some(o) => return Err(self.err(format!("param `approximate` is `{o}`, expected \"none\" or \"tanh\""))),
                };
                (Step::Gelu(a), same())
            }
            "layernorm" => {
                self.check_params(&["weight", "bias", "eps"])?;
                let n = need_width()?;
                let weight = self.tensor("weight", &[Some(n)], used)?.data().to_vec();
                let bias = self.tensor("bias", &[Some(n)], used)?.data().to_vec();
                let eps = match self.spec.params.get("eps") {
                    Some(Value::Number(e)) => e.as_f64().unwrap_or(f64::NAN),
                    None => 1e-5,
                    Some(v) => return Err(self.err(format!("param `eps` must be a number, found {v}"))),
                };
                if !(eps > 0.0 && eps < 1.0) {
                    return Err(self.err(format!("param `eps` is {eps}, expected in (0, 1)")));
                }
                (Step::LayerNorm { weight, bias, eps: eps as f32 }, same())
            }
            "softmax" => {
                self.check_params(&["dim"])?;
                need_width()?;
                let last = in_shape.len() as i64; // counting the batch axis
                match self.spec.params.get("dim") {
                    None => {}
                    Some(Value::Number(d)) if d.as_i64() == Some(-1) || d.as_i64() == Some(last) => {}
                    Some(v) => return Err(self.err(format!("param `dim` is {v}; only the last axis (-1) is supported"))),
                }
                (Step::Softmax, same())
            }
            "embedding" => {
                self.check_params(&["weight"])?;
                let t = self.tensor("weight", &[None, None], used)?;
                let dim = t.shape()[1];
                let mut out = in_shape.to_vec();
                out.push(dim);
                if out.len() > MAX_RANK {
                    return Err(self.err(format!("output rank {} exceeds {MAX_RANK}", out.len())));
                }
                (Step::Embedding { table: t.data().to_vec(), dim }, out)
            }
            "add" => {
                self.check_params(&[])?;
                if ins[0].1 != ins[1].1 {
                    return Err(self.err(format!(
                        "inputs `{}` and `{}` have shapes {:?} and {:?}; add needs equal shapes",
                        self.spec.inputs[0], self.spec.inputs[1], ins[0].1, ins[1].1
                    )));
                }
                (Step::Add, same())
            }
            other => {
                return Err(self.err(format!(
                    "unknown op `{other}`; known: linear, relu, gelu, layernorm, softmax, embedding, add"
                )))
            }
        })
    }
}
