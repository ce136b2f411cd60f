//! `bench load --idle-clients N --slow-clients M`: a normal load measured alone and beside
//! connections that hold the server without asking anything: idle clients (connect, send
//! nothing, reconnect as soon as they are closed) and slow-loris clients (a header byte a
//! second, never finishing the headers, reconnecting when closed). Rounds alternate without
//! and with them, so both see the machine's conditions.

use super::load::{self, LoadReport, LoadSettings};
use serde::Serialize;
use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// How long the slow connections run before the measured load starts.
const WARM_UP: Duration = Duration::from_secs(3);
/// What a slow-loris client trickles: a request line, then a header that never ends.
const SLOW_HEADER: &[u8] = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Idle,
    SlowLoris,
}

struct Connection {
    kind: Kind,
    stream: Option<TcpStream>,
    /// Bytes of `SLOW_HEADER` sent (then `a`s, forever).
    sent: usize,
}

/// What the slow connections went through while a measured load ran.
#[derive(Debug, Clone, Default, Serialize)]
pub struct SlowStats {
    /// Connections the server closed (each then reopened).
    pub idle_closed: usize,
    pub slow_closed: usize,
    /// Connections that could not be opened (the server's or this process's limit).
    pub refused: usize,
}

fn connect(addr: SocketAddr, stats: &mut SlowStats) -> Option<TcpStream> {
    match TcpStream::connect_timeout(&addr, Duration::from_secs(5)) {
        Ok(stream) => {
            stream.set_nonblocking(true).ok()?;
            Some(stream)
        }
        Err(_) => {
            stats.refused += 1;
            None
        }
    }
}

/// Whether the server closed the connection (bytes it sent, e.g. a 408, are read away).
fn closed_by_server(stream: &mut TcpStream) -> bool {
    let mut buf = [0u8; 4096];
    loop {
        match stream.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e) if e.kind() == ErrorKind::WouldBlock => return false,
            Err(_) => return true,
        }
    }
}

/// Keeps `idle` idle and `slow` slow-loris connections open until `stop`.
fn drive(addr: SocketAddr, idle: usize, slow: usize, stop: &AtomicBool) -> SlowStats {
    let mut stats = SlowStats::default();
    let mut connections: Vec<Connection> = std::iter::repeat_n(Kind::Idle, idle)
        .chain(std::iter::repeat_n(Kind::SlowLoris, slow))
        .map(|kind| Connection {
            kind,
            stream: connect(addr, &mut stats),
            sent: 0,
        })
        .collect();
    let mut last_byte = Instant::now();
    while !stop.load(Ordering::Relaxed) {
        let trickle = last_byte.elapsed() >= Duration::from_secs(1);
        if trickle {
            last_byte = Instant::now();
        }
        for c in &mut connections {
            let alive = match &mut c.stream {
                None => false,
                Some(stream) => {
                    let wrote = !(trickle && c.kind == Kind::SlowLoris) || {
                        let byte = SLOW_HEADER.get(c.sent).copied().unwrap_or(b'a');
                        stream.write(&[byte]).is_ok_and(|n| n == 1)
                    };
                    c.sent += 1;
                    wrote && !closed_by_server(stream)
                }
            };
            if !alive {
                match c.kind {
                    Kind::Idle => stats.idle_closed += 1,
                    Kind::SlowLoris => stats.slow_closed += 1,
                }
                c.stream = connect(addr, &mut stats);
                c.sent = 0;
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    stats
}

/// One round: the normal load alone, then beside the slow connections.
#[derive(Debug, Clone, Serialize)]
pub struct Round {
    pub alone: LoadReport,
    pub beside: LoadReport,
    pub slow: SlowStats,
}

#[derive(Debug, Clone, Serialize)]
pub struct SlowClientReport {
    pub idle_clients: usize,
    pub slow_clients: usize,
    pub rounds: Vec<Round>,
}

/// The normal load's p50 may grow this much beside the slow clients, its p99 this much.
pub const P50_LIMIT: f64 = 1.5;
pub const P99_LIMIT: f64 = 2.0;

impl SlowClientReport {
    fn median_ratio(&self, pick: fn(&LoadReport) -> f64) -> f64 {
        let mut ratios: Vec<f64> = self
            .rounds
            .iter()
            .map(|r| pick(&r.beside) / pick(&r.alone).max(1e-9))
            .collect();
        super::median(&mut ratios)
    }

    pub fn p50_ratio(&self) -> f64 {
        self.median_ratio(|r| r.latency_ms_p50)
    }

    pub fn p99_ratio(&self) -> f64 {
        self.median_ratio(|r| r.latency_ms_p99)
    }

    /// Every normal request completed (none refused or lost for the slow connections), and
    /// the latency stayed within the limits.
    pub fn passed(&self) -> bool {
        let all_completed = |r: &LoadReport| r.outcomes.get("completed") == Some(&r.requests);
        self.rounds
            .iter()
            .all(|r| all_completed(&r.alone) && all_completed(&r.beside) && r.beside.passed())
            && self.p50_ratio() <= P50_LIMIT
            && self.p99_ratio() <= P99_LIMIT
    }

    pub fn markdown(&self) -> String {
        let mut out = format!(
            "Normal load beside {} idle and {} slow-loris connections, {} rounds:\n\n\
             | round | completed alone / beside | p50 ms alone / beside | p99 ms alone / beside \
             | idle closed | slow-loris closed | refused connections |\n\
             |---:|---|---|---|---:|---:|---:|\n",
            self.idle_clients,
            self.slow_clients,
            self.rounds.len()
        );
        let completed = |r: &LoadReport| r.outcomes.get("completed").copied().unwrap_or(0);
        for (k, r) in self.rounds.iter().enumerate() {
            out += &format!(
                "| {k} | {} / {} | {:.0} / {:.0} | {:.0} / {:.0} | {} | {} | {} |\n",
                completed(&r.alone),
                completed(&r.beside),
                r.alone.latency_ms_p50,
                r.beside.latency_ms_p50,
                r.alone.latency_ms_p99,
                r.beside.latency_ms_p99,
                r.slow.idle_closed,
                r.slow.slow_closed,
                r.slow.refused,
            );
        }
        out += &format!(
            "\nMedian over rounds of beside / alone: p50 {:.2}× (limit {P50_LIMIT}×), p99 {:.2}× \
             (limit {P99_LIMIT}×). **{}**\n",
            self.p50_ratio(),
            self.p99_ratio(),
            if self.passed() { "PASS" } else { "FAIL" }
        );
        out
    }
}

/// Runs `rounds` rounds of `settings`' load alone and beside the slow connections.
pub fn run(
    settings: &LoadSettings,
    idle: usize,
    slow: usize,
    rounds: usize,
) -> anyhow::Result<SlowClientReport> {
    let host = settings
        .url
        .trim_start_matches("http://")
        .split('/')
        .next()
        .unwrap_or_default();
    let addr = host
        .to_socket_addrs()?
        .next()
        .ok_or_else(|| anyhow::anyhow!("cannot resolve {host}"))?;
    let mut report = SlowClientReport {
        idle_clients: idle,
        slow_clients: slow,
        rounds: Vec::new(),
    };
    for _ in 0..rounds {
        let alone = load::run(settings);
        let stop = AtomicBool::new(false);
        let (beside, slow_stats) = std::thread::scope(|scope| {
            let driver = scope.spawn(|| drive(addr, idle, slow, &stop));
            std::thread::sleep(WARM_UP);
            let beside = load::run(settings);
            stop.store(true, Ordering::Relaxed);
            (beside, driver.join().unwrap_or_default())
        });
        report.rounds.push(Round {
            alone,
            beside,
            slow: slow_stats,
        });
    }
    Ok(report)
}
