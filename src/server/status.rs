//! `/v1/models`, `/health` and `/metrics`.

use super::AppState;
use crate::policy::registry::PolicyRegistry;
use crate::policy::PolicyInfo;
use actix_web::{web, HttpResponse};
use serde_json::{json, Value};

/// A policy as clients and admins see it: model names instead of indices.
pub fn policy_json(info: &PolicyInfo, model_names: &[&str]) -> Value {
    json!({
        "kind": info.kind,
        "models": info.models.iter().map(|&i| model_names[i]).collect::<Vec<_>>(),
        "learned_router": info.learned_router,
        "rule": info.rule,
        // Through f32's shortest decimal form, so 0.1 reads 0.1 and not 0.10000000149.
        "threshold": info.threshold.and_then(|t| t.to_string().parse::<f64>().ok()),
    })
}

pub fn registry_json(registry: &PolicyRegistry, model_names: &[&str]) -> Value {
    let policies: serde_json::Map<String, Value> = registry
        .all()
        .map(|p| {
            (
                p.name().to_string(),
                policy_json(&p.describe(), model_names),
            )
        })
        .collect();
    json!({"default": registry.default_policy().name(), "policies": policies})
}

/// Each physical model and each policy: the names a request's `model` may take.
pub async fn models(state: web::Data<AppState>) -> HttpResponse {
    let names = state.runtime.model_names();
    let registry = state.runtime.policies();
    let default = registry.default_policy().name().to_string();
    let entry =
        |id: &str| json!({"id": id, "object": "model", "created": 0, "owned_by": "tokenrouter"});
    let mut data: Vec<Value> = names
        .iter()
        .map(|name| {
            let mut model = entry(name);
            model["kind"] = json!("model");
            model
        })
        .collect();
    data.extend(
        registry
            .all()
            .filter(|p| p.describe().kind != "single")
            .map(|p| {
                let mut policy = entry(p.name());
                policy["kind"] = json!("policy");
                policy["default"] = json!(p.name() == default);
                policy["policy"] = policy_json(&p.describe(), &names);
                policy
            }),
    );
    HttpResponse::Ok().json(json!({"object": "list", "data": data}))
}

pub async fn health(state: web::Data<AppState>) -> HttpResponse {
    HttpResponse::Ok().json(json!({
        "status": "ok",
        "mode": state.runtime.mode().as_str(),
        "models": state.runtime.model_names(),
        "live_requests": state.runtime.live_requests(),
        "queued_requests": state.admission.queued(),
    }))
}

pub async fn metrics(state: web::Data<AppState>) -> HttpResponse {
    HttpResponse::Ok()
        .content_type("text/plain; version=0.0.4")
        .body(state.metrics.render())
}
