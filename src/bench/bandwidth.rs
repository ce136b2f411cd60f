//! The machine's memory read bandwidth, measured beside `bench engine`: decoding one token
//! reads every weight matrix once, so weight bytes / bandwidth bounds the B = 1 step from
//! below, and the step's share of that bound says how close the kernels come to it.

use serde::Serialize;
use std::hint::black_box;
use std::time::Instant;

/// At least this much is read per pass, far beyond any cache.
pub const PROBE_BYTES: usize = 1 << 30;
/// Passes; the fastest counts (noise on a shared machine only slows a pass down).
const PASSES: usize = 5;

#[derive(Debug, Clone, Serialize)]
pub struct Bound {
    pub read_gb_per_s: f64,
    pub probe_threads: usize,
    /// Bytes of every weight matrix one decode step reads (the output head included).
    pub weight_bytes: u64,
    /// weight_bytes / read bandwidth.
    pub bound_ms: f64,
    /// bound_ms / the measured B = 1 step.
    pub fraction_of_bound: f64,
}

impl Bound {
    pub fn new(read_gb_per_s: f64, probe_threads: usize, weight_bytes: u64, b1_ms: f64) -> Self {
        let bound_ms = weight_bytes as f64 / (read_gb_per_s * 1e9) * 1e3;
        Self {
            read_gb_per_s,
            probe_threads,
            weight_bytes,
            bound_ms,
            fraction_of_bound: bound_ms / b1_ms,
        }
    }
}

/// GB/s of a streaming read of `bytes` split over `threads` threads, best of five passes.
pub fn read_gb_per_s(bytes: usize, threads: usize) -> f64 {
    let threads = threads.max(1);
    let words = bytes / 8;
    // Written once, so every page is resident before the timed passes.
    let data: Vec<u64> = (0..words as u64).collect();
    let share = words.div_ceil(threads);
    let mut best = f64::INFINITY;
    for _ in 0..PASSES {
        let start = Instant::now();
        std::thread::scope(|scope| {
            for part in data.chunks(share) {
                scope.spawn(move || black_box(sum(part)));
            }
        });
        best = best.min(start.elapsed().as_secs_f64());
    }
    (words * 8) as f64 / best / 1e9
}

/// Eight independent lanes, so the loads are not serialised behind one add chain.
fn sum(words: &[u64]) -> u64 {
    let mut lanes = [0u64; 8];
    let chunks = words.chunks_exact(8);
    let tail: u64 = chunks.remainder().iter().fold(0, |a, &w| a.wrapping_add(w));
    for chunk in chunks {
        for (lane, &w) in lanes.iter_mut().zip(chunk) {
            *lane = lane.wrapping_add(w);
        }
    }
    lanes.iter().fold(tail, |a, &l| a.wrapping_add(l))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sum_reads_every_word() {
        let words: Vec<u64> = (1..=1003).collect();
        assert_eq!(sum(&words), 1003 * 1004 / 2);
    }

    #[test]
    fn the_bound_is_bytes_over_bandwidth() {
        let bound = Bound::new(20.0, 2, 100_000_000, 10.0);
        assert!((bound.bound_ms - 5.0).abs() < 1e-9);
        assert!((bound.fraction_of_bound - 0.5).abs() < 1e-9);
    }
}
