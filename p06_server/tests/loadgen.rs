//! The load generator (common::loadgen) against a live server: every
//! request completes with exactly the asked-for output length, the timings
//! are consistent with each other, and the report adds up.

mod support;

use std::time::Duration;

use common::loadgen::{self, Api, Arrival, LoadConfig, LoadRequest, Report, Slo};
use common::rng::Rng;
use p06_server::bench::random_prompt;
use support::{smollm2, TestServer, MODEL};

fn config(url: &str, arrival: Arrival, api: Api) -> LoadConfig {
    LoadConfig {
        base_url: url.to_string(),
        model: Some(MODEL.to_string()),
        api,
        arrival,
        max_concurrency: None,
        ignore_eos: true,
        temperature: 0.0,
        timeout: Duration::from_secs(120),
        slo: Slo {
            ttft_ms: Some(60_000.0),
            ..Slo::default()
        },
    }
}

fn requests(n: usize, input: usize, output: usize) -> Vec<LoadRequest> {
    let tok = &smollm2().tokenizer;
    let mut rng = Rng::new(5);
    (0..n)
        .map(|_| {
            let (prompt, ids) =
                random_prompt(tok, input, &mut rng).expect("SmolLM2 has plain tokens");
            assert_eq!(
                ids.len(),
                input,
                "random prompts have the asked-for token count"
            );
            assert_eq!(
                tok.encode(&prompt),
                ids,
                "and round-trip through the tokenizer"
            );
            LoadRequest {
                prompt,
                prompt_len: ids.len(),
                output_len: output,
            }
        })
        .collect()
}

#[tokio::test]
async fn closed_and_open_loop_runs_measure_every_request() {
    let srv = TestServer::default().await;
    let reqs = requests(5, 24, 6);
    for (arrival, api) in [
        (Arrival::Closed { concurrency: 2 }, Api::Completions),
        (
            Arrival::Poisson {
                rate: 20.0,
                seed: 1,
            },
            Api::Chat,
        ),
    ] {
        let cfg = config(&srv.url, arrival, api);
        let (records, duration) = loadgen::run(&cfg, &reqs[..1], &reqs[1..]).await.unwrap();
        assert_eq!(records.len(), 4);
        for r in &records {
            assert!(r.ok, "{}", r.error);
            assert_eq!(r.output_len, 6, "ignore_eos gives the exact length");
            if api == Api::Completions {
                assert_eq!(r.prompt_len, 24, "usage from the stream");
            }
            assert!(r.ttft > 0.0 && r.ttft < r.latency);
            assert!(r.itl.len() <= 5 && !r.itl.is_empty());
            let sum: f64 = r.itl.iter().sum();
            assert!(sum <= r.latency - r.ttft + 1e-9);
        }
        let rep = Report::new(&records, duration, &cfg.slo);
        assert_eq!((rep.completed, rep.failed), (4, 0));
        assert_eq!(rep.total_output_tokens, 24);
        assert!((rep.request_throughput - 4.0 / duration).abs() < 1e-9);
        assert!(rep.request_goodput <= rep.request_throughput);
        assert!(rep.ttft.median > 0.0 && rep.e2el.p99 >= rep.e2el.median);
    }
    // The server saw the warm-ups too, and nothing else.
    assert_eq!(srv.metric("vllm:generation_tokens_total").await, 60.0);
}

#[tokio::test]
async fn errors_are_recorded_not_fatal_and_warmup_failures_are() {
    let srv = TestServer::default().await;
    let mut reqs = requests(2, 8, 4);
    reqs[1].output_len = 100_000; // over the context: the server answers 400
    let cfg = config(
        &srv.url,
        Arrival::Closed { concurrency: 1 },
        Api::Completions,
    );
    let (records, _) = loadgen::run(&cfg, &[], &reqs).await.unwrap();
    assert!(records[0].ok);
    assert!(
        !records[1].ok && records[1].error.starts_with("400"),
        "{}",
        records[1].error
    );
    assert!(loadgen::run(&cfg, &reqs[1..], &reqs[..1]).await.is_err());
}
