//! Bad models and bad inputs fail at load (or at the input check) with typed
//! errors that name the file, the node and expected vs found, never a panic.

use std::path::{Path, PathBuf};

use common::Tensor;
use p01_engine::{Graph, GraphError};
use serde_json::{json, Value};

/// A scratch copy of the MLP fixture whose model.json is `edit`ed.
struct Scratch(PathBuf);

impl Scratch {
    fn new(tag: &str, edit: impl FnOnce(&mut Value)) -> Scratch {
        let src = p01_engine::fixtures_dir().join("mlp");
        let dir = std::env::temp_dir().join(format!("p01-bad-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::copy(
            src.join("weights.safetensors"),
            dir.join("weights.safetensors"),
        )
        .unwrap();
        let mut g: Value =
            serde_json::from_str(&std::fs::read_to_string(src.join("model.json")).unwrap())
                .unwrap();
        edit(&mut g);
        std::fs::write(
            dir.join("model.json"),
            serde_json::to_string_pretty(&g).unwrap(),
        )
        .unwrap();
        Scratch(dir)
    }
    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        std::fs::remove_dir_all(&self.0).ok();
    }
}

fn load_err(tag: &str, edit: impl FnOnce(&mut Value)) -> String {
    let s = Scratch::new(tag, edit);
    match Graph::load(s.path()) {
        Ok(_) => panic!("{tag}: a bad model loaded"),
        Err(e) => e.to_string(),
    }
}

fn assert_mentions(msg: &str, parts: &[&str]) {
    for p in parts {
        assert!(msg.contains(p), "error `{msg}` should mention `{p}`");
    }
}

#[test]
fn unknown_op_names_node_and_op() {
    let e = load_err("op", |g| g["nodes"][1]["op"] = json!("swish"));
    assert_mentions(&e, &["model.json", "node 1", "unknown op `swish`"]);
}

#[test]
fn missing_param_and_missing_tensor() {
    let e = load_err("param", |g| {
        g["nodes"][2]["params"]
            .as_object_mut()
            .unwrap()
            .remove("weight");
    });
    assert_mentions(&e, &["node 2 (linear -> h2)", "missing param `weight`"]);
    let e = load_err("tensor", |g| {
        g["nodes"][4]["params"]["bias"] = json!("fc9.bias")
    });
    assert_mentions(&e, &["node 4", "`fc9.bias`", "weights.safetensors"]);
    let e = load_err("typo", |g| {
        g["nodes"][0]["params"]["wieght"] = json!("fc1.weight")
    });
    assert_mentions(&e, &["node 0", "unknown param `wieght`"]);
}

#[test]
fn shapes_that_do_not_chain_name_expected_and_found() {
    // fc2 (128, 256) fed the 784-wide input instead of a1.
    let e = load_err("chain", |g| g["nodes"][2]["inputs"] = json!(["x"]));
    assert_mentions(
        &e,
        &[
            "node 2 (linear -> h2)",
            "`fc2.weight`",
            "[128, 256]",
            "expected [_, 784]",
        ],
    );
    // The input declared 783 wide.
    let e = load_err("width", |g| g["input"]["shape"] = json!([783]));
    assert_mentions(&e, &["node 0", "[256, 784]", "expected [_, 783]"]);
    // A zero-sized input dimension (would reach a linear with 0 inputs and
    // ops that split rows by width): refused at load.
    let e = load_err("zero", |g| g["input"]["shape"] = json!([0, 784]));
    assert_mentions(&e, &["every dimension >= 1"]);
    // A bias of the wrong length.
    let e = load_err("bias", |g| {
        g["nodes"][0]["params"]["bias"] = json!("fc2.bias")
    });
    assert_mentions(&e, &["node 0", "`fc2.bias`", "[128]", "expected [256]"]);
    // add of two different widths.
    let e = load_err("add", |g| {
        g["nodes"]
            .as_array_mut()
            .unwrap()
            .push(json!({"op": "add", "inputs": ["x", "logits"], "params": {}, "output": "z"}));
        g["output"] = json!("z");
    });
    assert_mentions(&e, &["node 5 (add -> z)", "[784]", "[10]"]);
}

#[test]
fn wiring_errors() {
    let e = load_err("undef", |g| g["nodes"][1]["inputs"] = json!(["h9"]));
    assert_mentions(&e, &["node 1", "input `h9`"]);
    let e = load_err("dup", |g| g["nodes"][3]["output"] = json!("h1"));
    assert_mentions(&e, &["node 3", "`h1` is already defined"]);
    let e = load_err("out", |g| g["output"] = json!("nothing"));
    assert_mentions(&e, &["model.json", "output `nothing`"]);
    let e = load_err("arity", |g| g["nodes"][1]["inputs"] = json!(["h1", "x"]));
    assert_mentions(&e, &["node 1", "takes 1 input(s), found 2"]);
    let e = load_err("type", |g| g["nodes"][0]["params"]["weight"] = json!(3));
    assert_mentions(&e, &["node 0", "`weight` must be a string"]);
    let e = load_err("json", |g| *g = json!({"nodes": "no"}));
    assert_mentions(&e, &["model.json", "invalid model JSON"]);
}

#[test]
fn missing_and_truncated_weights_name_the_file() {
    let s = Scratch::new("missing", |_| {});
    std::fs::remove_file(s.path().join("weights.safetensors")).unwrap();
    let e = Graph::load(s.path()).unwrap_err();
    assert!(matches!(e, GraphError::Io { .. }), "{e}");
    assert_mentions(&e.to_string(), &["weights.safetensors"]);

    let full = std::fs::read(p01_engine::fixtures_dir().join("mlp/weights.safetensors")).unwrap();
    let header = 8 + u64::from_le_bytes(full[..8].try_into().unwrap()) as usize;
    for cut in [
        0,
        4,
        8,
        9,
        header - 1,
        header,
        header + 1,
        full.len() / 2,
        full.len() - 1,
    ] {
        std::fs::write(s.path().join("weights.safetensors"), &full[..cut]).unwrap();
        let e = Graph::load(s.path()).unwrap_err();
        assert!(matches!(e, GraphError::Weights(_)), "cut {cut}: {e}");
        assert_mentions(&e.to_string(), &["weights.safetensors"]);
    }
}

#[test]
fn random_corruption_never_panics() {
    let src = p01_engine::fixtures_dir().join("mlp");
    let json = std::fs::read(src.join("model.json")).unwrap();
    let weights = std::fs::read(src.join("weights.safetensors")).unwrap();
    let s = Scratch::new("flip", |_| {});
    let mut rng = common::rng::Rng::new(0x2545_F491_4F6C_DD1D);
    let mut next = || rng.next_u64();
    let mut errors = 0;
    for i in 0..200 {
        let (mut j, mut w) = (json.clone(), weights[..4096].to_vec());
        // Flip bits in the JSON, or in the safetensors header region.
        if i % 2 == 0 {
            let at = next() as usize % j.len();
            j[at] ^= 1 << (next() % 8);
        } else {
            let header = 8 + u64::from_le_bytes(weights[..8].try_into().unwrap()) as usize;
            let at = next() as usize % header.min(w.len());
            w[at] ^= 1 << (next() % 8);
        }
        w.extend_from_slice(&weights[4096..]);
        std::fs::write(s.path().join("model.json"), &j).unwrap();
        std::fs::write(s.path().join("weights.safetensors"), &w).unwrap();
        if Graph::load(s.path()).is_err() {
            errors += 1;
        }
    }
    assert!(
        errors > 50,
        "most corruptions should be rejected, only {errors} were"
    );
}

#[test]
fn input_of_the_wrong_shape_is_an_error() {
    let engine = Graph::load(p01_engine::fixtures_dir().join("mlp")).unwrap();
    for shape in [vec![2, 783], vec![784], vec![1, 28, 28]] {
        let x = Tensor::zeros(shape.clone()).unwrap();
        match engine.forward(&x) {
            Err(GraphError::Input { expected, found }) => {
                assert_eq!((expected, found), (vec![784], shape));
            }
            other => panic!("{shape:?}: {other:?}"),
        }
    }
    let mut ws = p01_engine::Workspace::default();
    assert!(engine.forward_into(&mut ws, &[0.0; 784], 2).is_err());
    assert!(engine.forward_into(&mut ws, &[0.0; 784 * 2], 2).is_ok());
}

#[test]
fn out_of_range_embedding_id_is_an_error_naming_the_node() {
    let engine = Graph::load(p01_engine::fixtures_dir().join("every_op")).unwrap();
    let mut ids = vec![1.0f32; 8];
    ids[5] = 50.0; // vocab is 50
    let e = engine
        .forward(&Tensor::new(vec![1, 8], ids).unwrap())
        .unwrap_err();
    assert_mentions(
        &e.to_string(),
        &["node 0 (embedding -> e)", "index 5", "[0, 50)"],
    );
}
