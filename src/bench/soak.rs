//! What `bench load` samples while it runs: the server's resident memory and open file
//! descriptors (from `/proc`, so on the same host), its KV in use and cached (`/metrics`),
//! and the latency of the requests that completed since the previous sample; and the soak's
//! verdict on them: memory flat once the prefix cache has reached its cap (the KV budget),
//! descriptors back to idle.

use serde::Serialize;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// A soak's memory must end within this fraction of its reference.
pub const RSS_TOLERANCE: f64 = 0.05;
/// The memory reference is a sample after this warm-up (allocator arenas, lazily touched
/// buffers): the first with the KV full, or the first at all where it never fills.
const RSS_REFERENCE_AFTER: Duration = Duration::from_secs(300);
/// The KV (requests and prefix cache) counts as full from this fraction of its budget: a
/// block's memory, once touched, is kept for reuse, so from then on it no longer grows.
const KV_FULL: f64 = 0.98;

#[derive(Debug, Clone, Serialize)]
pub struct Sample {
    /// Seconds since the load started (0: just before it).
    pub at_s: f64,
    pub rss_mib: Option<f64>,
    pub fds: Option<usize>,
    /// Summed over the models.
    pub kv_tokens_used: f64,
    pub kv_tokens_cached: f64,
    pub kv_tokens_capacity: f64,
    /// Requests completed since the previous sample, and their latency.
    pub completed: usize,
    pub latency_ms_p50: Option<f64>,
    pub latency_ms_p99: Option<f64>,
}

#[derive(Debug, Clone, Serialize)]
pub struct SoakCheck {
    /// The sample memory is compared with: the first after 5 minutes with the KV at its
    /// budget (or, where it never got there, the first after 5 minutes).
    pub rss_reference_at_s: f64,
    pub rss_reference_mib: f64,
    /// Whether the KV was at its budget at the reference (else: 5 minutes in).
    pub kv_full_at_reference: bool,
    pub rss_end_mib: f64,
    pub fds_idle: usize,
    pub fds_after: usize,
}

impl SoakCheck {
    pub fn rss_change(&self) -> f64 {
        self.rss_end_mib / self.rss_reference_mib - 1.0
    }

    pub fn passed(&self) -> bool {
        self.rss_change().abs() <= RSS_TOLERANCE && self.fds_after <= self.fds_idle
    }

    /// From the samples of a run (the first before the load, the last after it).
    pub fn from_samples(samples: &[Sample]) -> Option<Self> {
        if samples.len() < 3 {
            return None;
        }
        let (idle, end) = (&samples[0], &samples[samples.len() - 1]);
        let during = &samples[1..samples.len() - 1];
        let kv_full = |s: &Sample| {
            s.kv_tokens_capacity > 0.0
                && s.kv_tokens_used + s.kv_tokens_cached >= KV_FULL * s.kv_tokens_capacity
        };
        let late = || {
            during
                .iter()
                .filter(|s| s.at_s >= RSS_REFERENCE_AFTER.as_secs_f64())
        };
        let reference = late().find(|s| kv_full(s)).or_else(|| late().next())?;
        Some(Self {
            rss_reference_at_s: reference.at_s,
            rss_reference_mib: reference.rss_mib?,
            kv_full_at_reference: kv_full(reference),
            rss_end_mib: end.rss_mib?,
            fds_idle: idle.fds?,
            fds_after: end.fds?,
        })
    }
}

/// Resident memory of a process in MiB.
pub fn rss_mib(pid: u32) -> Option<f64> {
    status_mib(pid, "VmRSS:")
}

/// The most resident memory a process has had, in MiB.
pub fn peak_rss_mib(pid: u32) -> Option<f64> {
    status_mib(pid, "VmHWM:")
}

/// A `kB` field of `/proc/PID/status` in MiB.
fn status_mib(pid: u32, field: &str) -> Option<f64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kib: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix(field))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kib / 1024.0)
}

/// Open file descriptors of a process.
pub fn fds(pid: u32) -> Option<usize> {
    Some(std::fs::read_dir(format!("/proc/{pid}/fd")).ok()?.count())
}

/// Completed requests' latencies, in the order they ended, for windowed percentiles.
#[derive(Default)]
pub struct Latencies {
    ended: Mutex<Vec<(Instant, f64)>>,
}

impl Latencies {
    pub fn record(&self, latency: Duration) {
        let mut ended = self.ended.lock().unwrap_or_else(|e| e.into_inner());
        ended.push((Instant::now(), latency.as_secs_f64() * 1e3));
    }

    /// Latencies (ms) of requests that ended in `[from, to)`.
    pub fn between(&self, from: Instant, to: Instant) -> Vec<f64> {
        let ended = self.ended.lock().unwrap_or_else(|e| e.into_inner());
        ended
            .iter()
            .filter(|(at, _)| *at >= from && *at < to)
            .map(|&(_, ms)| ms)
            .collect()
    }

    pub fn all(&self) -> Vec<f64> {
        let ended = self.ended.lock().unwrap_or_else(|e| e.into_inner());
        ended.iter().map(|&(_, ms)| ms).collect()
    }
}

/// The `q`-quantile (nearest rank); none of an empty sample.
pub fn quantile(values: &[f64], q: f64) -> Option<f64> {
    if values.is_empty() {
        return None;
    }
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    Some(sorted[rank - 1])
}

/// The markdown table of the samples.
pub fn table(samples: &[Sample]) -> String {
    let mut out = String::from(
        "| t (s) | RSS MiB | open fds | KV used | KV cached | completed | p50 ms | p99 ms |\n\
         |---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    let opt = |v: Option<f64>, digits: usize| v.map_or("–".into(), |v| format!("{v:.digits$}"));
    for s in samples {
        out += &format!(
            "| {:.0} | {} | {} | {:.0} | {:.0} | {} | {} | {} |\n",
            s.at_s,
            opt(s.rss_mib, 1),
            s.fds.map_or("–".into(), |n| n.to_string()),
            s.kv_tokens_used,
            s.kv_tokens_cached,
            s.completed,
            opt(s.latency_ms_p50, 0),
            opt(s.latency_ms_p99, 0),
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(at_s: f64, rss: f64, fds: usize, cached: f64) -> Sample {
        Sample {
            at_s,
            rss_mib: Some(rss),
            fds: Some(fds),
            kv_tokens_used: 100.0,
            kv_tokens_cached: cached,
            kv_tokens_capacity: 1100.0,
            completed: 0,
            latency_ms_p50: None,
            latency_ms_p99: None,
        }
    }

    #[test]
    fn memory_is_judged_from_the_first_sample_after_five_minutes_with_the_kv_at_its_budget() {
        let samples = vec![
            sample(-1.0, 100.0, 20, 0.0),
            sample(200.0, 250.0, 90, 1000.0),
            sample(240.0, 300.0, 90, 900.0),
            sample(300.0, 380.0, 90, 950.0),
            sample(330.0, 400.0, 90, 1000.0),
            sample(600.0, 410.0, 90, 200.0),
            sample(601.0, 415.0, 20, 1000.0),
        ];
        let check = SoakCheck::from_samples(&samples).unwrap();
        assert_eq!(check.rss_reference_at_s, 330.0);
        assert!(check.kv_full_at_reference);
        assert!((check.rss_change() - 0.0375).abs() < 1e-9);
        assert!(check.passed());
        let mut leaking = samples.clone();
        leaking.last_mut().unwrap().rss_mib = Some(430.0);
        assert!(!SoakCheck::from_samples(&leaking).unwrap().passed());
        let mut holding = samples;
        holding.last_mut().unwrap().fds = Some(21);
        assert!(!SoakCheck::from_samples(&holding).unwrap().passed());
    }

    #[test]
    fn without_a_full_kv_the_reference_is_the_first_sample_after_five_minutes() {
        let samples = vec![
            sample(-1.0, 100.0, 20, 0.0),
            sample(240.0, 300.0, 90, 500.0),
            sample(310.0, 380.0, 90, 900.0),
            sample(600.0, 390.0, 90, 700.0),
            sample(601.0, 395.0, 20, 0.0),
        ];
        let check = SoakCheck::from_samples(&samples).unwrap();
        assert_eq!(check.rss_reference_at_s, 310.0);
        assert!(!check.kv_full_at_reference);
    }

    #[test]
    fn a_run_shorter_than_five_minutes_has_no_memory_verdict() {
        let samples = vec![sample(-1.0, 1.0, 1, 0.0), sample(30.0, 2.0, 2, 5.0)];
        assert!(SoakCheck::from_samples(&samples).is_none());
    }
}
