//! Admin routes (bearer token; disabled without one): read and hot-swap the policy
//! registry, and per-model runtime statistics.

use super::error::ApiError;
use super::status::RegistryView;
use super::{parse, read_json, AppState};
use crate::config::PolicyUpdate;
use actix_web::{web, HttpRequest, HttpResponse};
use serde::Serialize;

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
    Ok(HttpResponse::Ok().json(RegistryView::new(&registry, &state.runtime.model_names())))
}

/// Validates the whole new registry, then swaps it in; on error the old one stays.
pub async fn put_policy(
    state: web::Data<AppState>,
    req: HttpRequest,
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    authorize(&state, &req)?;
    let body = read_json(&req, payload, &state.config).await?;
    let update: PolicyUpdate = parse(&body)?;
    let registry = state.runtime.update_policies(&update)?;
    Ok(HttpResponse::Ok().json(RegistryView::new(&registry, &state.runtime.model_names())))
}

/// One model's line in `/admin/stats`.
#[derive(Debug, Serialize)]
struct ModelStatsView<'a> {
    model: &'a str,
    steps: u64,
    tokens_processed: u64,
    mean_batch_size: f64,
    kv_tokens_used: usize,
    pending_requests: usize,
    restarts: u64,
}

#[derive(Debug, Serialize)]
struct StatsView<'a> {
    mode: &'static str,
    live_requests: usize,
    models: Vec<ModelStatsView<'a>>,
}

pub async fn stats(state: web::Data<AppState>, req: HttpRequest) -> Result<HttpResponse, ApiError> {
    authorize(&state, &req)?;
    let snapshot = state.runtime.snapshot();
    let models = snapshot
        .models
        .iter()
        .map(|m| ModelStatsView {
            model: &m.name,
            steps: m.steps,
            tokens_processed: m.tokens_processed,
            mean_batch_size: m.mean_batch(),
            kv_tokens_used: m.kv_tokens_used,
            pending_requests: m.pending,
            restarts: m.restarts,
        })
        .collect();
    Ok(HttpResponse::Ok().json(StatsView {
        mode: snapshot.mode.as_str(),
        live_requests: snapshot.live_requests,
        models,
    }))
}
