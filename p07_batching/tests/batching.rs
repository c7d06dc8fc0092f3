//! The batcher's guarantees: members of a lock-step batch generate what they
//! would alone (SmolLM2 and the tiny GPT-2), a cancelled member leaves the
//! others undisturbed and frees its K/V, and waiting requests share a batch.

mod support;

use std::time::Duration;

use common::batch::{Batch, BatchModel};
use common::engine::{Engine, EngineEvent, EngineRequest, Finish, PromptInput};
use common::ModelInfo;
use p04_transformer::Tokenizer;
use p05_kv_cache::generate::{generate, GenerateParams, Sequence};
use p05_kv_cache::kv_cache::KvCache;
use p07_batching::{BatchConfig, BatchingEngine};
use support::{smollm2, MODEL};

/// What each member saw: its tokens and its logits row at every step.
type Trace = (Vec<u32>, Vec<Vec<f32>>);

/// Run `members` (prompt, max_tokens) as one lock-step batch the way the
/// batcher does: prefill together, then one token per live member per step.
fn lockstep<M: BatchModel>(
    model: &M,
    tok: &Tokenizer,
    members: &[(Vec<u32>, usize)],
) -> Vec<Trace> {
    let shape = model.kv_shape();
    let vocab = model.info().vocab_size;
    let mut ws = model.new_workspace();
    let mut seqs: Vec<Sequence> = members
        .iter()
        .map(|(p, n)| {
            Sequence::new::<M::Error>(model.info(), p, &GenerateParams::greedy(*n)).unwrap()
        })
        .collect();
    let mut kvs: Vec<KvCache> = members
        .iter()
        .map(|(p, n)| KvCache::new(shape.n_layer, shape.n_kv_head, shape.head_dim, p.len() + n))
        .collect();
    let mut traces: Vec<Trace> = vec![(Vec::new(), Vec::new()); members.len()];
    let mut batch = Batch::new();
    let mut prefill = true;
    loop {
        batch.clear();
        let mut live = Vec::new();
        for (i, s) in seqs.iter().enumerate() {
            if s.is_finished() {
                continue;
            }
            match s.next_input() {
                Some(t) if !prefill => batch.push(&[t], kvs[i].len()).unwrap(),
                _ => batch.push(s.prompt(), kvs[i].len()).unwrap(),
            };
            live.push(i);
        }
        if live.is_empty() {
            return traces;
        }
        let mut stores: Vec<&mut KvCache> = kvs
            .iter_mut()
            .enumerate()
            .filter(|(i, _)| live.contains(i))
            .map(|(_, k)| k)
            .collect();
        let mut logits = vec![0.0f32; live.len() * vocab];
        model
            .forward_batch(&batch, &mut stores, &mut ws, &mut logits)
            .unwrap();
        prefill = false;
        for (r, &i) in live.iter().enumerate() {
            let row = &mut logits[r * vocab..(r + 1) * vocab];
            traces[i].1.push(row.to_vec());
            let step = seqs[i].on_logits(row, tok);
            traces[i].0.push(step.token);
        }
    }
}

/// Each member of a mixed batch against itself alone: tokens identical,
/// logits within 1e-5 of the logit scale at every step.
fn members_equal_alone<M: BatchModel>(model: &M, tok: &Tokenizer, members: &[(Vec<u32>, usize)]) {
    let together = lockstep(model, tok, members);
    let mut worst = 0.0f32;
    for (i, m) in members.iter().enumerate() {
        let alone = lockstep(model, tok, std::slice::from_ref(m)).remove(0);
        assert_eq!(together[i].0, alone.0, "member {i}: tokens differ");
        assert_eq!(together[i].0.len(), m.1, "member {i}: token count");
        for (step, (a, b)) in together[i].1.iter().zip(&alone.1).enumerate() {
            let scale = b.iter().fold(0.0f32, |s, x| s.max(x.abs()));
            let d = common::compare::diff(a, b, 0.0, 0.0).unwrap().max_abs / scale;
            worst = worst.max(d);
            assert!(
                d <= 1e-5,
                "member {i} step {step}: logits differ by {d:e} of scale"
            );
        }
    }
    eprintln!(
        "{} members: worst relative logit diff {worst:e}",
        members.len()
    );
}

fn prompt(tok: &Tokenizer, text: &str) -> Vec<u32> {
    tok.encode(text)
}

#[test]
fn smollm2_batch_members_equal_themselves_alone() {
    let s = smollm2();
    let tok = &s.tokenizer;
    let members = vec![
        (prompt(tok, "The capital of France is"), 12),
        (
            prompt(
                tok,
                "Once upon a time, in a small village by the sea, there lived an old fisherman who",
            ),
            20,
        ),
        (prompt(tok, "def fib(n):"), 3),
        (prompt(tok, "1, 2, 3, 4,"), 16),
        (vec![1u32], 8),
    ];
    members_equal_alone(&*s.engine, tok, &members);
    // A batch of one is p05's generation exactly.
    for (p, n) in &members {
        let want = generate(&*s.engine, tok, p, &GenerateParams::greedy(*n), |_| {})
            .unwrap()
            .tokens;
        let got = lockstep(&*s.engine, tok, &[(p.clone(), *n)]).remove(0).0;
        assert_eq!(got, want);
    }
}

#[test]
fn tiny_gpt2_batch_members_equal_themselves_alone() {
    let m = p04_transformer::Gpt2::from_hf_dir(&p04_transformer::fixtures_dir().join("tiny_gpt2"))
        .unwrap();
    let info = ModelInfo {
        name: "tiny".into(),
        vocab_size: 101,
        context_length: 64,
        bos_id: None,
        stop_ids: vec![],
    };
    let engine = p05_kv_cache::gpt2_engine::Gpt2Engine::new(m, info);
    // Any tokenizer turns the tiny model's ids (< 101) into text.
    let tok = &smollm2().tokenizer;
    let members = vec![
        ((0..9).collect::<Vec<u32>>(), 10),
        (vec![42], 25),
        ((30..47).collect(), 2),
        (vec![7, 7, 7], 15),
    ];
    members_equal_alone(&engine, tok, &members);
}

async fn collect(mut rx: common::engine::EngineStream) -> (String, Option<Finish>, usize) {
    let (mut text, mut finish, mut n) = (String::new(), None, 0);
    while let Some(ev) = rx.recv().await {
        match ev {
            EngineEvent::Token(t) => {
                text.push_str(&t.text);
                n += 1;
            }
            EngineEvent::Done { finish: f, .. } => finish = Some(f),
            EngineEvent::Error(e) => panic!("{e}"),
        }
    }
    (text, finish, n)
}

fn request(id: usize, text: &str, max_tokens: usize) -> EngineRequest {
    let mut r = EngineRequest::new(format!("cmpl-{id}"), PromptInput::Text(text.into()));
    r.max_tokens = Some(max_tokens);
    r.sampling.temperature = 0.0;
    r.ignore_eos = true;
    r
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiting_requests_share_a_batch_and_a_cancelled_member_disturbs_no_one() {
    let s = smollm2();
    let config = BatchConfig {
        max_batch: 8,
        max_wait: Duration::from_millis(200),
        max_waiting: 16,
    };
    let engine =
        BatchingEngine::start(s.engine.clone(), s.tokenizer.clone(), MODEL, config).unwrap();
    // Keep the engine busy, so the next requests queue and leave together.
    let busy = engine.submit(request(0, "Hello", 12)).unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    let prompts = [
        "The capital of France is",
        "Rust is a language that",
        "In 1969,",
    ];
    let lens = [6usize, 14, 9];
    let streams: Vec<_> = prompts
        .iter()
        .zip(lens)
        .enumerate()
        .map(|(i, (p, n))| engine.submit(request(i + 1, p, n)).unwrap())
        .collect();
    let mut victim = engine
        .submit(request(9, "Tell me a long story about", 40))
        .unwrap();
    collect(busy).await;
    // Two tokens in, the client leaves.
    for _ in 0..2 {
        assert!(matches!(victim.recv().await, Some(EngineEvent::Token(_))));
    }
    drop(victim);
    let mut got = Vec::new();
    for rx in streams {
        got.push(collect(rx).await);
    }
    // Each survivor equals its own generation alone.
    for ((p, n), (text, finish, count)) in prompts.iter().zip(lens).zip(&got) {
        let ids = s.tokenizer.encode(p);
        let want = generate(
            &*s.engine,
            &s.tokenizer,
            &ids,
            &GenerateParams::greedy(n),
            |_| {},
        )
        .unwrap();
        assert_eq!(text, &want.text, "{p}");
        assert_eq!((*finish, *count), (Some(Finish::Length), n));
    }
    let st = engine.stats();
    assert_eq!(st.batches, 2, "the busy request, then the four together");
    let mut text = String::new();
    st.render(&mut text, "model_name=\"m\"");
    assert!(
        text.contains("inference_lab:batch_size_bucket{model_name=\"m\",le=\"4\"} 2"),
        "{text}"
    );
    assert!(
        st.empty_slot_steps > 0,
        "finished and cancelled members leave empty slots"
    );
    // Everything finished: no K/V held.
    let t0 = std::time::Instant::now();
    while engine.load().kv_cache_bytes != 0 || engine.load().running != 0 {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "{:?}",
            engine.load()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}
