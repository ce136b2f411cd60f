//! Joining a deployment: every process learns every model's facts (vocabulary, sizes,
//! mode) from the process hosting it before it serves.

use super::cluster::{Bus, ClusterError};
use super::wire::{self, ModelFacts};
use crate::config::{Config, ExecutionMode};
use std::time::{Duration, Instant};

/// Every model's facts: the hosted ones as given, the others asked of their hosts until they
/// answer or `timeout` passes. Hosted models answer `describe` as soon as this process
/// serves them, so two processes joining at once do not wait for each other.
pub(crate) fn join(
    bus: &Bus,
    config: &Config,
    hosted: Vec<Option<ModelFacts>>,
    timeout: Duration,
    mode: ExecutionMode,
) -> Result<Vec<ModelFacts>, ClusterError> {
    let mut known = hosted;
    let waiting: Vec<usize> = (0..known.len()).filter(|&i| known[i].is_none()).collect();
    // Answer for our own models now, before waiting for the others.
    for (idx, facts) in known.iter().enumerate() {
        if let Some(facts) = facts {
            let (replier, payload) = (bus.clone(), wire::encode(facts));
            bus.subscribe(
                bus.model_subject(&config.models[idx].name, "describe"),
                move |_, reply| {
                    if let Some(reply) = reply {
                        replier.publish(reply.to_string(), payload.clone());
                    }
                },
            )?;
        }
    }
    let started = Instant::now();
    for idx in waiting {
        let name = &config.models[idx].name;
        loop {
            let asked = bus.request(
                bus.model_subject(name, "describe"),
                Vec::new(),
                Duration::from_millis(500),
            );
            if let Some(reply) = asked {
                let facts = wire::decode::<ModelFacts>(&reply).map_err(|reason| {
                    ClusterError::BadReply {
                        model: name.clone(),
                        reason,
                    }
                })?;
                if facts.mode != mode {
                    return Err(ClusterError::BadReply {
                        model: name.clone(),
                        reason: format!(
                            "mode `{}` where this process runs `{}`: every process of a \
                             deployment must run the same mode",
                            facts.mode.as_str(),
                            mode.as_str()
                        ),
                    });
                }
                bus.beat(name, &facts.host, None);
                known[idx] = Some(facts);
                break;
            }
            if started.elapsed() >= timeout {
                return Err(ClusterError::NoHost {
                    model: name.clone(),
                    waited_ms: timeout.as_millis() as u64,
                });
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }
    Ok(known
        .into_iter()
        .map(|f| f.expect("every model answered"))
        .collect())
}
