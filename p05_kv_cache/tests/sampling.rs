//! Sampling tests that can fail: top-k 1 is greedy; seeds reproduce and
//! differ; draws follow the filtered softmax (chi-square); top-p keeps the
//! smallest set reaching p; invalid settings are errors.

use p05_kv_cache::sampling::{
    apply_repetition_penalty, argmax, Sampler, SamplingError, SamplingParams,
};

fn logits() -> Vec<f32> {
    vec![1.0, 3.2, -0.5, 2.9, 0.3, 2.0, -2.0, 1.7]
}

fn params(temperature: f32) -> SamplingParams {
    SamplingParams {
        temperature,
        ..SamplingParams::greedy()
    }
}

#[test]
fn top_k_one_and_temperature_zero_are_greedy() {
    let greedy = argmax(&logits());
    assert_eq!(greedy, 1);
    let mut s = Sampler::new(SamplingParams {
        top_k: Some(1),
        seed: Some(9),
        ..params(1.5)
    })
    .unwrap();
    for _ in 0..200 {
        assert_eq!(s.sample(&mut logits(), &[]), greedy);
    }
    let mut s = Sampler::new(params(0.0)).unwrap();
    assert_eq!(s.sample(&mut logits(), &[]), greedy);
}

#[test]
fn same_seed_same_draws_other_seed_differs() {
    let draw = |seed| {
        let mut s = Sampler::new(SamplingParams {
            seed: Some(seed),
            ..params(1.0)
        })
        .unwrap();
        (0..64)
            .map(|_| s.sample(&mut logits(), &[]))
            .collect::<Vec<_>>()
    };
    assert_eq!(draw(42), draw(42));
    assert_ne!(draw(42), draw(43));
}

#[test]
fn draws_follow_the_filtered_softmax() {
    // temperature 0.8, top-k 5, then min-p 0.05: the reference distribution is
    // computed here independently, in f64, from the definition.
    let p = SamplingParams {
        temperature: 0.8,
        top_k: Some(5),
        min_p: 0.05,
        seed: Some(7),
        ..SamplingParams::greedy()
    };
    let l = logits();
    let mut idx: Vec<usize> = (0..l.len()).collect();
    idx.sort_by(|&a, &b| l[b].total_cmp(&l[a]));
    let kept: Vec<usize> = idx[..5].to_vec();
    let z: f64 = kept.iter().map(|&i| (f64::from(l[i]) / 0.8).exp()).sum();
    let mut probs: Vec<(usize, f64)> = kept
        .iter()
        .map(|&i| (i, (f64::from(l[i]) / 0.8).exp() / z))
        .collect();
    let top = probs[0].1;
    probs.retain(|&(_, q)| q >= 0.05 * top);
    let z2: f64 = probs.iter().map(|p| p.1).sum();
    probs.iter_mut().for_each(|p| p.1 /= z2);

    let n = 40_000;
    let mut s = Sampler::new(p).unwrap();
    let mut counts = vec![0usize; l.len()];
    for _ in 0..n {
        counts[s.sample(&mut logits(), &[]) as usize] += 1;
    }
    for (i, &c) in counts.iter().enumerate() {
        if !probs.iter().any(|&(j, _)| j == i) {
            assert_eq!(c, 0, "token {i} was filtered out but drawn {c} times");
        }
    }
    let chi2: f64 = probs
        .iter()
        .map(|&(i, q)| {
            let e = q * n as f64;
            (counts[i] as f64 - e).powi(2) / e
        })
        .sum();
    // df = kept - 1; 0.1% critical values: df 3 -> 16.27, df 4 -> 18.47.
    let crit = [0.0, 10.83, 13.82, 16.27, 18.47][probs.len() - 1];
    assert!(
        chi2 < crit,
        "chi-square {chi2:.2} >= {crit} (df {}), counts {counts:?}, expected {probs:?}",
        probs.len() - 1
    );
}

#[test]
fn top_p_keeps_the_smallest_set_reaching_p() {
    let l = logits();
    for top_p in [0.3f32, 0.5, 0.8, 0.95, 1.0] {
        let mut s = Sampler::new(SamplingParams {
            top_p,
            ..params(1.0)
        })
        .unwrap();
        let dist: Vec<(f32, u32)> = s.distribution(&mut l.clone(), &[]).to_vec();
        // Reference: full softmax sorted; smallest prefix with mass >= p.
        let z: f64 = l.iter().map(|&x| f64::from(x).exp()).sum();
        let mut full: Vec<(f64, u32)> = l
            .iter()
            .enumerate()
            .map(|(i, &x)| (f64::from(x).exp() / z, i as u32))
            .collect();
        full.sort_by(|a, b| b.0.total_cmp(&a.0));
        let mut mass = 0.0;
        let mut k = full.len();
        for (i, f) in full.iter().enumerate() {
            mass += f.0;
            if mass >= f64::from(top_p) {
                k = i + 1;
                break;
            }
        }
        let want: Vec<u32> = full[..k].iter().map(|f| f.1).collect();
        let got: Vec<u32> = dist.iter().map(|d| d.1).collect();
        assert_eq!(got, want, "top_p {top_p}");
        let total: f32 = dist.iter().map(|d| d.0).sum();
        assert!((total - 1.0).abs() < 1e-5);
    }
}

#[test]
fn repetition_penalty_follows_transformers_rule() {
    let mut l = vec![2.0, -1.0, 0.5];
    apply_repetition_penalty(&mut l, &[0, 1, 0], 2.0);
    assert_eq!(
        l,
        vec![1.0, -2.0, 0.5],
        "positive / p, negative * p, once per token"
    );
    // Ids past the vocabulary are ignored; a long history with repeats
    // (the seen set is a bitset: linear) penalises each token once, across
    // the bitset's 64-id words.
    let mut l = vec![1.0f32; 130];
    let history: Vec<u32> = (0..10_000).map(|i| [5, 64, 129, 7, 500][i % 5]).collect();
    apply_repetition_penalty(&mut l, &history, 4.0);
    for (i, v) in l.iter().enumerate() {
        let want = if [5, 7, 64, 129].contains(&i) {
            0.25
        } else {
            1.0
        };
        assert_eq!(*v, want, "logit {i}");
    }
}

#[test]
fn invalid_settings_are_errors() {
    let bad = |p: SamplingParams| Sampler::new(p).unwrap_err();
    assert_eq!(bad(params(-0.1)), SamplingError::Temperature(-0.1));
    assert_eq!(
        bad(SamplingParams {
            top_p: 0.0,
            ..params(1.0)
        }),
        SamplingError::TopP(0.0)
    );
    assert_eq!(
        bad(SamplingParams {
            top_p: 1.5,
            ..params(1.0)
        }),
        SamplingError::TopP(1.5)
    );
    assert_eq!(
        bad(SamplingParams {
            top_k: Some(0),
            ..params(1.0)
        }),
        SamplingError::TopK
    );
    assert_eq!(
        bad(SamplingParams {
            min_p: 2.0,
            ..params(1.0)
        }),
        SamplingError::MinP(2.0)
    );
    assert!(matches!(
        bad(params(f32::NAN)),
        SamplingError::Temperature(_)
    ));
}

/// A vocabulary large and flat enough that top-p needs several rounds of
/// the growing selection (64, 256, 1,024, 4,096 ...) and min-p keeps
/// thousands: both must equal the sorted-prefix definition.
#[test]
fn top_p_and_min_p_match_the_definition_on_a_flat_vocabulary() {
    let mut rng = p05_kv_cache::sampling::Rng::new(3);
    let l: Vec<f32> = (0..5000).map(|_| rng.next_f32() * 2.0).collect();
    let z: f64 = l.iter().map(|&x| f64::from(x).exp()).sum();
    let mut full: Vec<(f64, u32)> = l
        .iter()
        .enumerate()
        .map(|(i, &x)| (f64::from(x).exp() / z, i as u32))
        .collect();
    full.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
    for top_p in [0.05f32, 0.5, 0.9, 0.999] {
        let mut s = Sampler::new(SamplingParams {
            top_p,
            ..params(1.0)
        })
        .unwrap();
        let got: Vec<u32> = s
            .distribution(&mut l.clone(), &[])
            .iter()
            .map(|d| d.1)
            .collect();
        let mut mass = 0.0;
        let k = full
            .iter()
            .position(|f| {
                mass += f.0;
                mass >= f64::from(top_p)
            })
            .map_or(full.len(), |i| i + 1);
        assert!(
            k > 64 || top_p < 0.1,
            "top_p {top_p}: the case must need a second round"
        );
        // f32 probabilities against an f64 reference: the cut may move by a
        // token where the running mass crosses p within rounding.
        assert!(
            got.len().abs_diff(k) <= 1,
            "top_p {top_p}: kept {} of want {k}",
            got.len()
        );
        let n = got.len().min(k);
        let want: Vec<u32> = full[..n].iter().map(|f| f.1).collect();
        assert_eq!(got[..n], want[..], "top_p {top_p}: the kept set in order");
    }
    let mut s = Sampler::new(SamplingParams {
        min_p: 0.5,
        ..params(1.0)
    })
    .unwrap();
    let got: Vec<u32> = s
        .distribution(&mut l.clone(), &[])
        .iter()
        .map(|d| d.1)
        .collect();
    let want: Vec<u32> = full
        .iter()
        .take_while(|f| f.0 >= full[0].0 * 0.5 * (1.0 - 1e-6))
        .map(|f| f.1)
        .collect();
    assert!(got.len().abs_diff(want.len()) <= 1 && got.len() > 1000);
    let n = got.len().min(want.len());
    assert_eq!(got[..n], want[..n]);
}

/// With no filter the draw walks the vocabulary unsorted: it must still
/// follow the softmax (chi-square at 0.1%).
#[test]
fn an_unfiltered_draw_follows_the_softmax() {
    let l = logits();
    let z: f64 = l.iter().map(|&x| (f64::from(x) / 0.7).exp()).sum();
    let n = 40_000;
    let mut s = Sampler::new(SamplingParams {
        temperature: 0.7,
        seed: Some(11),
        ..SamplingParams::greedy()
    })
    .unwrap();
    let mut counts = vec![0usize; l.len()];
    for _ in 0..n {
        counts[s.sample(&mut logits(), &[]) as usize] += 1;
    }
    let chi2: f64 = l
        .iter()
        .zip(&counts)
        .map(|(&x, &c)| {
            let e = (f64::from(x) / 0.7).exp() / z * n as f64;
            (c as f64 - e).powi(2) / e
        })
        .sum();
    // df 7: the 0.1% critical value is 24.32.
    assert!(chi2 < 24.32, "chi-square {chi2:.2}, counts {counts:?}");
}
