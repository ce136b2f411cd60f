//! SIMULATION, not a model: the latency-profile executor. Each step sleeps L(b) = a + c·b ms
//! for a batch of b sequences (or a + c·Σ of its rows' tokens priced by their context, where a
//! context cost is given) and reports routing signals drawn per (sequence, position):
//! entropy and 1 − max probability uniform in [0, 1), so a threshold θ on either is crossed
//! with probability 1 − θ. It lets the runtime's scheduling (actors, batchers, modes) be
//! checked against the Markov model on any machine, with the same `StepExecutor` contract.

use super::kv::{BlockCopy, KvStore, SeqId};
use super::{context_priced_tokens, LogitStats, SeqWork, StepExecutor, StepOutput};
use crate::error::EngineResult;
use std::time::{Duration, Instant};

/// Vocabulary the simulated candidates are drawn from.
const SIMULATED_VOCAB: usize = 1000;

pub struct LatencyProfileExecutor {
    name: String,
    a_ms: f64,
    c_ms: f64,
    /// Prices a row by its tokens and context (`context_priced_tokens`); `None`: a row is 1.
    context_cost: Option<f64>,
    salt: u64,
    kv: KvStore,
}

impl LatencyProfileExecutor {
    pub fn new(
        name: &str,
        latency_ms: [f64; 2],
        context_cost: Option<f64>,
        kv_tokens: usize,
    ) -> Self {
        let salt = name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
        });
        Self {
            name: name.to_string(),
            a_ms: latency_ms[0],
            c_ms: latency_ms[1],
            context_cost,
            salt,
            kv: KvStore::new(kv_tokens),
        }
    }

    /// A uniform draw in [0, 1) for this model, sequence and position.
    fn draw(&self, seq: SeqId, position: usize, stream: u64) -> f64 {
        let mut z = self.salt
            ^ seq.0.wrapping_mul(0x9E37_79B9_7F4A_7C15)
            ^ (position as u64) << 20
            ^ stream;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        (z >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Sleeps until `deadline` (spinning the last stretch: OS sleeps overshoot by ~0.1 ms).
fn sleep_until(deadline: Instant) {
    let coarse = Duration::from_micros(200);
    loop {
        let now = Instant::now();
        if now >= deadline {
            return;
        }
        let left = deadline - now;
        if left > coarse {
            std::thread::sleep(left - coarse);
        } else {
            std::hint::spin_loop();
        }
    }
}

impl StepExecutor for LatencyProfileExecutor {
    fn name(&self) -> &str {
        &self.name
    }

    fn vocab_size(&self) -> usize {
        SIMULATED_VOCAB
    }

    fn hidden_size(&self) -> usize {
        1
    }

    fn context_length(&self) -> usize {
        usize::MAX
    }

    fn step(&mut self, work: &[SeqWork]) -> EngineResult<Vec<StepOutput>> {
        let start = Instant::now();
        // What c multiplies: the rows, or their tokens priced by their context.
        let units = match self.context_cost {
            Some(k) => work
                .iter()
                .map(|w| context_priced_tokens(self.kv.seq_len(w.seq), w.tokens.len(), k))
                .sum(),
            None => work.len() as f64,
        };
        let reservations: Vec<(SeqId, usize)> =
            work.iter().map(|w| (w.seq, w.tokens.len())).collect();
        self.kv.reserve(&reservations)?;
        let latency = self.a_ms + self.c_ms * units;
        sleep_until(start + Duration::from_secs_f64(latency.max(0.0) / 1000.0));
        Ok(work
            .iter()
            .map(|w| {
                self.kv.advance(w.seq, &w.tokens);
                let position = self.kv.seq_len(w.seq);
                let uncertainty = self.draw(w.seq, position, 1) as f32;
                StepOutput {
                    seq: w.seq,
                    position,
                    candidate: (self.draw(w.seq, position, 2) * SIMULATED_VOCAB as f64) as u32,
                    logits: Vec::new(),
                    stats: LogitStats {
                        entropy: uncertainty,
                        max_prob: 1.0 - uncertainty,
                        top_k: Vec::new(),
                    },
                    hidden: w.needs.hidden.then(|| vec![0.0]),
                    candidate_embedding: w.needs.embedding.then(|| vec![0.0]),
                }
            })
            .collect())
    }

    fn kv(&self) -> &KvStore {
        &self.kv
    }

    fn kv_mut(&mut self) -> &mut KvStore {
        &mut self.kv
    }

    /// No KV contents to copy: only the bookkeeping is simulated.
    fn copy_block(&mut self, _copy: BlockCopy) -> EngineResult<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::{Needs, SamplingParams};

    #[test]
    fn steps_take_the_profiled_latency_and_draws_are_uniform() {
        let mut sim = LatencyProfileExecutor::new("sim", [2.0, 1.0], None, 1 << 20);
        let work: Vec<SeqWork> = (0..3).map(|seq| work(seq, 2)).collect();
        let start = Instant::now();
        let out = sim.step(&work).unwrap();
        assert!(start.elapsed() >= Duration::from_millis(5), "2 + 1·3 ms");
        assert_eq!(out[0].position, 2);
        let mut above = 0;
        for position in 0..10_000 {
            if sim.draw(SeqId(7), position, 1) >= 0.65 {
                above += 1;
            }
        }
        assert!((above as f64 / 10_000.0 - 0.35).abs() < 0.02, "{above}");
        sim.free(SeqId(0));
        sim.free(SeqId(1));
        sim.free(SeqId(2));
        assert_eq!(sim.kv_usage().used_tokens, 0);
    }

    fn work(seq: u64, tokens: usize) -> SeqWork {
        SeqWork {
            seq: SeqId(seq),
            tokens: vec![1; tokens],
            sampling: SamplingParams::greedy(),
            needs: Needs::default(),
            filter: None,
        }
    }

    /// With a context cost a step costs its rows' tokens, a late chunk more than an early one.
    #[test]
    fn with_a_context_cost_steps_cost_their_tokens_and_context() {
        let timed = |sim: &mut LatencyProfileExecutor, work: &[SeqWork]| {
            let start = Instant::now();
            sim.step(work).unwrap();
            start.elapsed().as_secs_f64() * 1e3
        };
        let mut sim = LatencyProfileExecutor::new("sim", [1.0, 0.5], Some(0.01), 1 << 20);
        // 1 + 0.5 · 20 · (1 + 0.01 · 9.5) ms: 11.95.
        let early = timed(&mut sim, &[work(0, 20)]);
        // 20 more after those 20: 1 + 0.5 · 20 · (1 + 0.01 · 29.5) ms = 13.95; with a decode
        // row of another sequence, + 0.5.
        let late = timed(&mut sim, &[work(0, 20), work(1, 1)]);
        // Sleeps only overshoot: without the context price they would end at 11 and 11.5 ms.
        assert!(early >= 11.95, "{early} ms");
        assert!(late >= 14.45, "{late} ms");
    }
}
