//! `/v1/models`, `/health` and `/metrics`.

use super::AppState;
use crate::policy::registry::PolicyRegistry;
use crate::policy::{PolicyInfo, PolicyKind};
use crate::runtime::ReplicaStatus;
use actix_web::{web, HttpResponse};
use serde::Serialize;
use std::collections::BTreeMap;

/// A policy as clients and admins see it: model names instead of indices.
#[derive(Debug, Serialize)]
pub struct PolicyView<'a> {
    kind: PolicyKind,
    models: Vec<&'a str>,
    learned_router: bool,
    rule: String,
    threshold: Option<f64>,
}

impl<'a> PolicyView<'a> {
    pub fn new(info: PolicyInfo, model_names: &[&'a str]) -> Self {
        Self {
            kind: info.kind,
            models: info.models.iter().map(|&i| model_names[i]).collect(),
            learned_router: info.learned_router,
            rule: info.rule,
            // Through f32's shortest decimal form, so 0.1 reads 0.1 and not 0.10000000149.
            threshold: info
                .threshold
                .and_then(|t| t.to_string().parse::<f64>().ok()),
        }
    }
}

/// The registry as `GET/PUT /admin/policy` answer it.
#[derive(Debug, Serialize)]
pub struct RegistryView<'a> {
    default: String,
    policies: BTreeMap<String, PolicyView<'a>>,
}

impl<'a> RegistryView<'a> {
    pub fn new(registry: &PolicyRegistry, model_names: &[&'a str]) -> Self {
        Self {
            default: registry.default_policy().name().to_string(),
            policies: registry
                .all()
                .map(|p| {
                    (
                        p.name().to_string(),
                        PolicyView::new(p.describe(), model_names),
                    )
                })
                .collect(),
        }
    }
}

/// One entry of `/v1/models`: a physical model, or a policy with its description.
#[derive(Debug, Serialize)]
struct ModelEntry<'a> {
    id: &'a str,
    object: &'static str,
    created: u64,
    owned_by: &'static str,
    /// `model` or `policy`.
    kind: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    default: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    policy: Option<PolicyView<'a>>,
}

#[derive(Debug, Serialize)]
struct ModelList<'a> {
    object: &'static str,
    data: Vec<ModelEntry<'a>>,
}

/// Each physical model and each policy: the names a request's `model` may take.
pub async fn models(state: web::Data<AppState>) -> HttpResponse {
    let names = state.runtime.model_names();
    let registry = state.runtime.policies();
    let default = registry.default_policy().name().to_string();
    let entry = |id, kind| ModelEntry {
        id,
        object: "model",
        created: 0,
        owned_by: "tokenrouter",
        kind,
        default: None,
        policy: None,
    };
    let mut data: Vec<ModelEntry> = names.iter().map(|name| entry(name, "model")).collect();
    data.extend(
        registry
            .all()
            .filter(|p| p.describe().kind != PolicyKind::Single)
            .map(|p| ModelEntry {
                default: Some(p.name() == default),
                policy: Some(PolicyView::new(p.describe(), &names)),
                ..entry(p.name(), "policy")
            }),
    );
    HttpResponse::Ok().json(ModelList {
        object: "list",
        data,
    })
}

#[derive(Debug, Serialize)]
struct Health<'a> {
    status: &'static str,
    mode: &'static str,
    models: Vec<&'a str>,
    live_requests: usize,
    queued_requests: usize,
    /// With models on workers: each remote replica as this front end sees it.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    replicas: Vec<ReplicaStatus>,
}

pub async fn health(state: web::Data<AppState>) -> HttpResponse {
    HttpResponse::Ok().json(Health {
        status: "ok",
        mode: state.runtime.mode().as_str(),
        models: state.runtime.model_names(),
        live_requests: state.runtime.live_requests(),
        queued_requests: state.admission.queued(),
        replicas: state.runtime.replicas(),
    })
}

pub async fn metrics(state: web::Data<AppState>) -> HttpResponse {
    HttpResponse::Ok()
        .content_type("text/plain; version=0.0.4")
        .body(state.metrics.render())
}
