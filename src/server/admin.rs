//! Admin routes (bearer token; disabled without one): read and hot-swap the policy
//! registry, and per-model runtime statistics.

use super::error::ApiError;
use super::status::registry_json;
use super::{parse, read_json, AppState};
use crate::config::PolicyUpdate;
use crate::runtime::stats::ModelStats;
use actix_web::{web, HttpRequest, HttpResponse};
use serde_json::json;
use std::sync::atomic::Ordering;

/// Compares in time independent of where the strings differ (the token is a secret).
fn same_secret(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn authorize(state: &AppState, req: &HttpRequest) -> Result<(), ApiError> {
    let expected = state
        .admin_token
        .as_deref()
        .ok_or(ApiError::AdminDisabled)?;
    let presented = req
        .headers()
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .ok_or(ApiError::Unauthorized)?;
    if same_secret(presented.as_bytes(), expected.as_bytes()) {
        Ok(())
    } else {
        Err(ApiError::Unauthorized)
    }
}

pub async fn get_policy(
    state: web::Data<AppState>,
    req: HttpRequest,
) -> Result<HttpResponse, ApiError> {
    authorize(&state, &req)?;
    let registry = state.runtime.policies();
    Ok(HttpResponse::Ok().json(registry_json(&registry, &state.runtime.model_names())))
}

/// Validates the whole new registry, then swaps it in; on error the old one stays.
pub async fn put_policy(
    state: web::Data<AppState>,
    req: HttpRequest,
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    authorize(&state, &req)?;
    let body = read_json(&req, payload, state.config.max_body_bytes).await?;
    let update: PolicyUpdate = parse(&body)?;
    let registry = state.runtime.update_policies(&update)?;
    Ok(HttpResponse::Ok().json(registry_json(&registry, &state.runtime.model_names())))
}

pub async fn stats(state: web::Data<AppState>, req: HttpRequest) -> Result<HttpResponse, ApiError> {
    authorize(&state, &req)?;
    let runtime = &state.runtime;
    let models: Vec<_> = runtime
        .model_names()
        .iter()
        .zip(&runtime.stats().models)
        .map(|(name, m)| {
            let steps = ModelStats::get(&m.steps);
            let log = m.step_log();
            let mean_batch = if log.is_empty() {
                0.0
            } else {
                log.iter().map(|s| s.batch as f64).sum::<f64>() / log.len() as f64
            };
            json!({
                "model": name,
                "steps": steps,
                "tokens_processed": ModelStats::get(&m.tokens_processed),
                "mean_batch_size": mean_batch,
                "kv_tokens_used": m.kv_tokens_used.load(Ordering::Relaxed),
                "pending_requests": m.pending.load(Ordering::Relaxed),
                "restarts": ModelStats::get(&m.restarts),
            })
        })
        .collect();
    Ok(HttpResponse::Ok().json(json!({
        "mode": runtime.mode().as_str(),
        "live_requests": runtime.live_requests(),
        "models": models,
    })))
}
