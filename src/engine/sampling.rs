//! Token sampling and the cheap logit reductions policies read. Randomness is seeded per
//! (request seed, position), so a token never depends on batching or on which model drew before.

use super::ops;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f32,
    /// 0 disables top-k.
    pub top_k: usize,
    /// 1.0 disables nucleus sampling.
    pub top_p: f32,
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self::greedy()
    }
}

impl SamplingParams {
    pub fn greedy() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: 0,
        }
    }

    pub fn is_greedy(&self) -> bool {
        self.temperature <= 0.0
    }

    /// Whether the draw is the largest logit whatever the seed (greedy, or top-k of one).
    pub fn picks_argmax(&self) -> bool {
        self.is_greedy() || self.top_k == 1
    }
}

/// The logit a masked-out token gets: far below any real logit, yet finite, so the
/// entropy's `p · log p` terms stay 0 rather than `0 · ∞`.
pub const MASKED_LOGIT: f32 = -1e30;

/// Which tokens a row's candidate may be: a structured-output grammar's next-token mask.
/// Computed during the forward pass, so it must not wait on the step.
pub trait TokenFilter: Send + Sync + std::fmt::Debug {
    fn allowed(&self) -> TokenMask;
}

/// A set of token ids, one bit each.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenMask {
    words: Vec<u32>,
}

impl TokenMask {
    /// Bit `t % 32` of word `t / 32` allows token `t`; ids past the words are not allowed.
    pub fn from_words(words: Vec<u32>) -> Self {
        Self { words }
    }

    /// Allows `tokens` too.
    pub fn allow(&mut self, tokens: impl IntoIterator<Item = u32>) {
        for t in tokens {
            let word = t as usize / 32;
            if self.words.len() <= word {
                self.words.resize(word + 1, 0);
            }
            self.words[word] |= 1 << (t % 32);
        }
    }

    pub fn allows(&self, token: u32) -> bool {
        let (word, bit) = (token as usize / 32, token % 32);
        self.words.get(word).is_some_and(|w| w >> bit & 1 == 1)
    }

    /// Sets every token it does not allow to [`MASKED_LOGIT`].
    pub fn apply(&self, logits: &mut [f32]) {
        for (t, logit) in logits.iter_mut().enumerate() {
            if !self.allows(t as u32) {
                *logit = MASKED_LOGIT;
            }
        }
    }
}

/// Runs `forward` while a helper thread computes each row's mask (`None` for a row without
/// a filter); a step without constrained rows spawns nothing and gets no masks.
pub fn with_masks<T: Send>(
    work: &[super::SeqWork],
    forward: impl FnOnce() -> T + Send,
) -> (T, Vec<Option<TokenMask>>) {
    if work.iter().all(|w| w.filter.is_none()) {
        return (forward(), Vec::new());
    }
    std::thread::scope(|scope| {
        let masks = scope.spawn(|| {
            work.iter()
                .map(|w| w.filter.as_ref().map(|f| f.allowed()))
                .collect()
        });
        let out = forward();
        (out, masks.join().expect("a token filter panicked"))
    })
}

/// Draws the next token for a sequence whose candidate will sit at `position`.
pub fn sample(logits: &[f32], params: &SamplingParams, position: usize) -> u32 {
    if params.picks_argmax() {
        return ops::argmax(logits) as u32;
    }
    let mut candidates: Vec<(u32, f32)> = logits
        .iter()
        .enumerate()
        .map(|(i, &l)| (i as u32, l / params.temperature))
        .collect();
    candidates.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    if params.top_k > 0 {
        candidates.truncate(params.top_k);
    }
    let mut probs: Vec<f32> = candidates.iter().map(|c| c.1).collect();
    ops::softmax_in_place(&mut probs);
    if params.top_p < 1.0 {
        let mut mass = 0.0;
        let keep = probs
            .iter()
            .position(|&p| {
                mass += p;
                mass >= params.top_p
            })
            .map_or(probs.len(), |i| i + 1);
        probs.truncate(keep);
    }
    let total: f32 = probs.iter().sum();
    let mut rng = StdRng::seed_from_u64(mix(params.seed, position as u64));
    let mut draw = rng.gen::<f32>() * total;
    for (i, &p) in probs.iter().enumerate() {
        if draw < p {
            return candidates[i].0;
        }
        draw -= p;
    }
    candidates[probs.len() - 1].0
}

/// SplitMix64 of the pair, so neighbouring positions get unrelated streams.
fn mix(seed: u64, position: u64) -> u64 {
    let mut z = seed ^ position.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Reductions of the next-token distribution (temperature 1) that routing rules use.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LogitStats {
    /// Shannon entropy in nats.
    pub entropy: f32,
    pub max_prob: f32,
    /// The `k` largest logits as `(token, logit)`, largest first; empty unless asked for.
    pub top_k: Vec<(u32, f32)>,
}

pub fn logit_stats(logits: &[f32], top_k: usize) -> LogitStats {
    let (sum_exp, weighted) = ops::exp_sums(logits, ops::max(logits));
    LogitStats::from_sums(sum_exp, weighted, top_logits(logits, top_k))
}

impl LogitStats {
    /// From one exp per logit: with e_i = exp(l_i − max), Z' = Σ e_i and W = Σ e_i (l_i − max),
    /// the entropy −Σ p_i log p_i = log Z' − W / Z' and the largest probability is 1 / Z'.
    pub fn from_sums(sum_exp: f32, weighted: f32, top_k: Vec<(u32, f32)>) -> Self {
        LogitStats {
            entropy: (sum_exp.ln() - weighted / sum_exp).max(0.0),
            max_prob: 1.0 / sum_exp,
            top_k,
        }
    }
}

/// The `k` largest logits as `(token, logit)`, largest first (lowest token on ties).
pub fn top_logits(logits: &[f32], k: usize) -> Vec<(u32, f32)> {
    if k == 0 || logits.is_empty() {
        return Vec::new();
    }
    let mut all: Vec<(u32, f32)> = logits
        .iter()
        .enumerate()
        .map(|(i, &l)| (i as u32, l))
        .collect();
    let k = k.min(all.len());
    let cmp = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
    all.select_nth_unstable_by(k - 1, cmp);
    all.truncate(k);
    all.sort_by(cmp);
    all
}

#[cfg(test)]
mod tests {
    use super::*;

    fn logits() -> Vec<f32> {
        (0..50).map(|i| ((i * 37) % 11) as f32 * 0.3).collect()
    }

    #[test]
    fn greedy_picks_the_first_maximum() {
        assert_eq!(
            sample(&[0.1, 2.0, 2.0, 1.0], &SamplingParams::greedy(), 0),
            1
        );
    }

    #[test]
    fn same_seed_and_position_same_token_and_seeds_differ() {
        let params = SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            seed: 42,
        };
        let a: Vec<u32> = (0..64).map(|p| sample(&logits(), &params, p)).collect();
        let b: Vec<u32> = (0..64).map(|p| sample(&logits(), &params, p)).collect();
        assert_eq!(a, b);
        let other = SamplingParams { seed: 43, ..params };
        let c: Vec<u32> = (0..64).map(|p| sample(&logits(), &other, p)).collect();
        assert_ne!(a, c, "a different seed must change some draws");
    }

    #[test]
    fn top_k_and_top_p_restrict_the_support() {
        let l = logits();
        let mut order: Vec<usize> = (0..l.len()).collect();
        order.sort_by(|&a, &b| l[b].total_cmp(&l[a]).then(a.cmp(&b)));
        let top3: Vec<u32> = order[..3].iter().map(|&i| i as u32).collect();
        let params = SamplingParams {
            temperature: 1.5,
            top_k: 3,
            top_p: 1.0,
            seed: 1,
        };
        for p in 0..200 {
            assert!(top3.contains(&sample(&l, &params, p)));
        }
        let nucleus = SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1e-6,
            seed: 9,
        };
        for p in 0..50 {
            assert_eq!(sample(&l, &nucleus, p), order[0] as u32);
        }
    }

    #[test]
    fn stats_of_uniform_and_peaked_distributions() {
        let uniform = logit_stats(&[0.0; 8], 2);
        assert!((uniform.entropy - 8f32.ln()).abs() < 1e-5);
        assert!((uniform.max_prob - 0.125).abs() < 1e-6);
        assert_eq!(uniform.top_k, vec![(0, 0.0), (1, 0.0)]);
        let peaked = logit_stats(&[0.0, 100.0, 0.0], 1);
        assert!(peaked.entropy < 1e-3 && peaked.max_prob > 0.999);
        assert_eq!(peaked.top_k, vec![(1, 100.0)]);
    }
}
