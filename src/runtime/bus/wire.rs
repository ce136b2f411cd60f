//! The runtime's messages as they cross the cluster bus (`[cluster]`): JSON, with a version
//! number in every payload. JSON because a handoff carries token ids and a little routing
//! state (hundreds of bytes, encoded in microseconds beside a step of milliseconds), and
//! because `nats sub 'tokenrouter.>'` then shows an operator what travels. A process refuses
//! a payload of another version with a logged error instead of misreading it.

use crate::config::{ExecutionMode, PolicyConfig};
use crate::engine::SamplingParams;
use crate::policy::{Handoff, ModelIdx, RoutingState};
use crate::runtime::core::{EngineTiming, RequestId, RoutingStats};
use crate::runtime::request::RequestEvent;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

/// Bumped whenever a payload's meaning changes.
pub(crate) const WIRE_VERSION: u32 = 3;

#[derive(Serialize, Deserialize)]
struct Versioned<T> {
    v: u32,
    #[serde(flatten)]
    body: T,
}

pub(crate) fn encode<T: Serialize>(body: &T) -> Vec<u8> {
    serde_json::to_vec(&Versioned {
        v: WIRE_VERSION,
        body,
    })
    .expect("wire messages serialize")
}

pub(crate) fn decode<T: DeserializeOwned>(payload: &[u8]) -> Result<T, String> {
    #[derive(Deserialize)]
    struct Version {
        v: u32,
    }
    let version: Version =
        serde_json::from_slice(payload).map_err(|e| format!("not a tokenrouter message: {e}"))?;
    if version.v != WIRE_VERSION {
        return Err(format!(
            "wire version {} (this build speaks {WIRE_VERSION})",
            version.v
        ));
    }
    serde_json::from_slice::<Versioned<T>>(payload)
        .map(|m| m.body)
        .map_err(|e| format!("malformed message: {e}"))
}

/// A request travelling to a model: everything `InFlight` holds but its client, which is
/// named by the front end that owns the request.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct WireRequest {
    pub state: RoutingState,
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    pub eos: Vec<u32>,
    pub policy: String,
    /// The policy's config entry as the request started with it (`None`: a model alone).
    pub policy_spec: Option<PolicyConfig>,
    pub logprobs: Option<usize>,
    pub stats: RoutingStats,
    pub handoff: Option<Handoff>,
    pub timing: EngineTiming,
    /// The process whose `RequestActor` streams this request to its client.
    pub frontend: String,
    /// Per model, the replica holding this request's KV there (`None`: not placed yet).
    pub hosts: Vec<Option<String>>,
}

/// Arrivals for one model (`<prefix>.model.<name>.admit`).
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct WireAdmit {
    pub requests: Vec<WireRequest>,
    /// When the sender queued this message (µs since the Unix epoch, its clock): the
    /// receiver's handoff transit.
    pub sent_unix_us: u64,
}

/// Now, in µs since the Unix epoch.
pub(crate) fn unix_us() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

/// A request ended (`<prefix>.model.<name>.withdraw`): forget it, free its KV.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct WireWithdraw {
    pub rid: RequestId,
}

/// The tuner's delayed-batching threshold (`<prefix>.model.<name>.threshold`).
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct WireThreshold {
    pub threshold: usize,
}

/// What a model's host says about it (`<prefix>.model.<name>.describe`, request/reply): what
/// the other processes check requests and policies against.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct ModelFacts {
    /// The replica that answered.
    pub host: String,
    /// The host's execution mode: every process of one deployment must run the same.
    pub mode: ExecutionMode,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub context_length: usize,
    /// The longest sequence its whole KV budget holds (`KvStore::longest_sequence`).
    pub longest_sequence_tokens: usize,
}

/// A model's host is alive (`<prefix>.heartbeat.<name>`).
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct Heartbeat {
    pub host: String,
    /// Requests live on that host.
    pub load: usize,
}

/// What a hosted model did lately (`<prefix>.record.<name>`, every quarter heartbeat): the
/// tuner of a front end, which sees none of a remote model's steps, estimates L(b) and the
/// routing matrix from these.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct RecordDigest {
    pub host: String,
    /// Steps since the previous digest, oldest first: rows, tokens appended, µs.
    pub steps: Vec<(usize, usize, u64)>,
    /// Cumulative on that host: request steps there followed by one on model j, and the
    /// tokens they committed.
    pub routed_to: Vec<u64>,
    pub committed_to: Vec<u64>,
}

/// `lockstep`: `host` asks the front end for the next turn to step
/// (`<prefix>.steplock.acquire`).
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct StepLockRequest {
    pub host: String,
}

/// A turn to step: granted (`<prefix>.steplock.grant.<host>`), and given back
/// (`<prefix>.steplock.release`).
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct StepLockGrant {
    pub grant: u64,
}

/// A process is alive as a front end (`<prefix>.frontend.<host>`), every heartbeat and
/// whenever its number of requests changes: hosts free the requests of a front end that
/// stops, and add up `requests` for their live count.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct FrontendBeat {
    pub host: String,
    /// Requests this process owns (streams to its clients) that have not ended.
    pub requests: usize,
}

/// An event for one request's client (`<prefix>.client.<frontend>`).
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct ClientEvent {
    pub rid: RequestId,
    pub event: WireEvent,
}

#[derive(Debug, Serialize, Deserialize)]
pub(crate) enum WireEvent {
    /// A token, the finish or the failure, as the client will see it.
    Request(RequestEvent),
    /// The request was placed on replica `host` of `model` (it stays there while its KV does).
    Placed { model: ModelIdx, host: String },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_round_trips_and_other_versions_are_refused() {
        let mut state = RoutingState::new(RequestId(7), vec![1, 2, 3], 2, 42);
        state.tokens.push(9);
        state.seen = vec![4, 3];
        let admit = WireAdmit {
            requests: vec![WireRequest {
                state,
                max_tokens: 16,
                sampling: SamplingParams::greedy(),
                eos: vec![2],
                policy: "r2r".into(),
                policy_spec: None,
                logprobs: Some(3),
                stats: RoutingStats {
                    tokens_per_model: vec![1, 0],
                    handoffs: 1,
                },
                handoff: Some(Handoff {
                    from: 0,
                    to: 1,
                    anchor: 3,
                    tokens: vec![9],
                }),
                timing: EngineTiming::default(),
                frontend: "f1".into(),
                hosts: vec![None, Some("h2".into())],
            }],
            sent_unix_us: 1_700_000_000_000_000,
        };
        let bytes = encode(&admit);
        let back: WireAdmit = decode(&bytes).unwrap();
        let r = &back.requests[0];
        assert_eq!(r.state.tokens, [1, 2, 3, 9]);
        assert_eq!(r.state.seen, [4, 3]);
        assert_eq!(r.handoff.as_ref().unwrap().tokens, [9]);
        assert_eq!((r.policy.as_str(), r.logprobs), ("r2r", Some(3)));
        assert_eq!(back.sent_unix_us, 1_700_000_000_000_000);

        let mut value: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
        value["v"] = (WIRE_VERSION + 1).into();
        let err = decode::<WireAdmit>(&serde_json::to_vec(&value).unwrap()).unwrap_err();
        assert!(err.contains("wire version"), "{err}");
        let err = decode::<WireAdmit>(b"hello").unwrap_err();
        assert!(err.contains("not a tokenrouter message"), "{err}");
    }
}
