//! `tokenrouter serve`: the OpenAI-compatible HTTP front of the runtime, with
//! admin routes for hot-swapping policies and a Prometheus endpoint.

mod admin;
mod admission;
mod error;
mod generate;
mod logprobs;
mod openai;
mod status;
mod text;
mod tools;

use crate::config::{Config, ServerConfig};
use crate::engine::chat::ChatTemplate;
use crate::engine::tokenizer::ModelTokenizer;
use crate::runtime::Runtime;
use crate::telemetry;
use actix_web::http::KeepAlive;
use actix_web::{web, App, HttpRequest, HttpResponse, HttpServer};
use admission::Admission;
use error::ApiError;
use futures_util::StreamExt;
use metrics_exporter_prometheus::PrometheusHandle;
use serde::de::DeserializeOwned;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tokio::signal::unix::{signal, Signal, SignalKind};

/// How often histograms are compacted and idle metrics expired.
const METRICS_UPKEEP: Duration = Duration::from_secs(5);

/// What every handler shares.
pub struct AppState {
    pub runtime: Arc<Runtime>,
    admission: Arc<Admission>,
    pub config: ServerConfig,
    admin_token: Option<String>,
    /// The chat template, or why there is none (then only chat requests fail).
    chat_template: Result<ChatTemplate, String>,
    metrics: PrometheusHandle,
}

impl AppState {
    pub fn new(
        runtime: Arc<Runtime>,
        admission: Arc<Admission>,
        config: &Config,
        metrics: PrometheusHandle,
    ) -> Self {
        // Built now rather than by the first request (the tokenizer's spelling of its tokens).
        if let Err(e) = runtime.spellings() {
            tracing::debug!("no token spelling: {e}");
        }
        let chat_template = runtime
            .tokenizer()
            .map_err(|e| e.to_string())
            .and_then(|t| ChatTemplate::for_model(t).map_err(|e| e.to_string()));
        let admin_token = std::env::var("TOKENROUTER_ADMIN_TOKEN")
            .ok()
            .or_else(|| config.server.admin_token.clone())
            .filter(|t| !t.is_empty());
        Self {
            runtime,
            admission,
            config: config.server.clone(),
            admin_token,
            chat_template,
            metrics,
        }
    }

    fn tokenizer(&self) -> Result<&Arc<ModelTokenizer>, ApiError> {
        Ok(self.runtime.tokenizer()?)
    }

    fn chat_template(&self) -> Result<&ChatTemplate, ApiError> {
        self.chat_template
            .as_ref()
            .map_err(|why| ApiError::invalid("messages", format!("chat is unavailable: {why}")))
    }
}

/// Every route; unknown paths and methods get OpenAI-shaped 404/405 errors.
pub fn routes(cfg: &mut web::ServiceConfig) {
    let resource = |path: &str| web::resource(path).default_service(web::to(wrong_method));
    cfg.service(resource("/v1/completions").route(web::post().to(generate::completions)))
        .service(resource("/v1/chat/completions").route(web::post().to(generate::chat_completions)))
        .service(resource("/v1/models").route(web::get().to(status::models)))
        .service(resource("/health").route(web::get().to(status::health)))
        .service(resource("/metrics").route(web::get().to(status::metrics)))
        .service(
            resource("/admin/policy")
                .route(web::get().to(admin::get_policy))
                .route(web::put().to(admin::put_policy)),
        )
        .service(resource("/admin/stats").route(web::get().to(admin::stats)))
        .default_service(web::to(no_route));
}

async fn no_route(req: HttpRequest) -> Result<HttpResponse, ApiError> {
    Err(ApiError::NoRoute {
        method: req.method().to_string(),
        path: req.path().to_string(),
    })
}

async fn wrong_method(req: HttpRequest) -> Result<HttpResponse, ApiError> {
    Err(ApiError::MethodNotAllowed {
        method: req.method().to_string(),
        path: req.path().to_string(),
    })
}

/// Reads a JSON body of at most `config.max_body_bytes` (413 beyond; 400 for anything not
/// JSON) within `config.body_timeout_ms` (408 and the connection closed past it).
async fn read_json(
    req: &HttpRequest,
    payload: web::Payload,
    config: &ServerConfig,
) -> Result<serde_json::Value, ApiError> {
    let timeout = Duration::from_millis(config.body_timeout_ms);
    let read = read_body(req, payload, config.max_body_bytes);
    let body = actix_web::rt::time::timeout(timeout, read)
        .await
        .map_err(|_| ApiError::BodyTimeout {
            after_ms: config.body_timeout_ms,
        })??;
    serde_json::from_slice(&body).map_err(|e| ApiError::InvalidRequest {
        message: format!("the body is not valid JSON: {e}"),
        param: None,
    })
}

async fn read_body(
    req: &HttpRequest,
    mut payload: web::Payload,
    limit: usize,
) -> Result<web::BytesMut, ApiError> {
    let declared = req
        .headers()
        .get("content-length")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok());
    if declared.is_some_and(|n| n > limit) {
        return Err(ApiError::PayloadTooLarge { limit });
    }
    let mut body = web::BytesMut::new();
    while let Some(chunk) = payload.next().await {
        let chunk =
            chunk.map_err(|e| ApiError::invalid("body", format!("cannot read the body: {e}")))?;
        if body.len() + chunk.len() > limit {
            return Err(ApiError::PayloadTooLarge { limit });
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body)
}

/// Deserializes a request body; a type error names the field it is in.
fn parse<T: DeserializeOwned>(body: &serde_json::Value) -> Result<T, ApiError> {
    serde_path_to_error::deserialize(body).map_err(|e| {
        let path = e.path().to_string();
        if path == "." {
            ApiError::InvalidRequest {
                message: e.inner().to_string(),
                param: None,
            }
        } else {
            ApiError::invalid(&path, format!("{path}: {}", e.inner()))
        }
    })
}

/// Loads the models, binds, and serves until SIGTERM/SIGINT, then drains: no new requests
/// (503), running ones get `shutdown_grace_s` to finish. SIGHUP re-reads the policies from
/// `config_path`.
pub async fn serve(config: Config, config_path: PathBuf) -> anyhow::Result<()> {
    let metrics = telemetry::install();
    let runtime = Arc::new(Runtime::start(&config, None)?);
    let limits = &config.server;
    let admission = Arc::new(Admission::new(
        limits.max_concurrent_requests,
        limits.max_queued_requests,
    ));
    let state = web::Data::new(AppState::new(
        runtime.clone(),
        admission.clone(),
        &config,
        metrics.clone(),
    ));
    // Installed before the "listening" line: until then these signals would still kill.
    let hangups = signal(SignalKind::hangup())?;
    let terminate = signal(SignalKind::terminate())?;
    let interrupt = signal(SignalKind::interrupt())?;
    let send_buffer = limits.send_buffer_bytes;
    let server = HttpServer::new(move || App::new().app_data(state.clone()).configure(routes))
        .on_connect(move |connection, _| {
            if let Some(tcp) = connection.downcast_ref::<actix_web::rt::net::TcpStream>() {
                if send_buffer > 0 {
                    let _ = socket2::SockRef::from(tcp).set_send_buffer_size(send_buffer);
                }
            }
        })
        .workers(limits.workers)
        .max_connections(limits.max_connections)
        .keep_alive(if limits.keep_alive_s > 0.0 {
            KeepAlive::Timeout(Duration::from_secs_f64(limits.keep_alive_s))
        } else {
            KeepAlive::Disabled
        })
        .client_request_timeout(Duration::from_millis(limits.header_timeout_ms))
        .client_disconnect_timeout(Duration::from_millis(limits.disconnect_timeout_ms))
        .shutdown_timeout(limits.shutdown_grace_s)
        .disable_signals()
        .bind((limits.host.as_str(), limits.port))?;
    for addr in server.addrs() {
        tracing::info!("tokenrouter listening on http://{addr}");
    }
    let server = server.run();
    actix_web::rt::spawn(keep_up(metrics));
    actix_web::rt::spawn(reload_on_hangup(hangups, runtime.clone(), config_path));
    actix_web::rt::spawn(drain_on_signal(
        terminate,
        interrupt,
        admission,
        server.handle(),
    ));
    server.await?;
    runtime.shutdown();
    tracing::info!("tokenrouter stopped");
    Ok(())
}

async fn drain_on_signal(
    mut terminate: Signal,
    mut interrupt: Signal,
    admission: Arc<Admission>,
    server: actix_web::dev::ServerHandle,
) {
    tokio::select! {
        _ = terminate.recv() => {}
        _ = interrupt.recv() => {}
    }
    tracing::info!("shutting down: draining running requests");
    admission.drain();
    server.stop(true).await;
}

async fn reload_on_hangup(mut hangups: Signal, runtime: Arc<Runtime>, config_path: PathBuf) {
    while hangups.recv().await.is_some() {
        let result = Config::load(&config_path)
            .map_err(crate::runtime::RuntimeError::from)
            .and_then(|reloaded| runtime.reload_policies(&reloaded));
        match result {
            Ok(registry) => tracing::info!(
                "SIGHUP: policies reloaded from {} (default `{}`)",
                config_path.display(),
                registry.default_policy().name()
            ),
            Err(e) => tracing::warn!("SIGHUP: reload refused, old policies kept: {e}"),
        }
    }
}

/// Compacts histograms and expires idle metrics, forever.
async fn keep_up(metrics: PrometheusHandle) {
    let mut interval = actix_web::rt::time::interval(METRICS_UPKEEP);
    loop {
        interval.tick().await;
        metrics.run_upkeep();
    }
}

/// `tokenrouter worker`'s own `/metrics` on `addr` (its models' steps, KV and batches): the
/// recorder is installed first, so call this before starting the worker's runtime.
pub fn serve_metrics_only(addr: &str) -> anyhow::Result<actix_web::dev::Server> {
    let metrics = telemetry::install();
    let render = metrics.clone();
    let server = HttpServer::new(move || {
        let render = render.clone();
        App::new().route(
            "/metrics",
            web::get().to(move || {
                let body = render.render();
                async move {
                    HttpResponse::Ok()
                        .content_type("text/plain; version=0.0.4")
                        .body(body)
                }
            }),
        )
    })
    .workers(1)
    .disable_signals()
    .bind(addr)?;
    for addr in server.addrs() {
        tracing::info!("worker metrics on http://{addr}/metrics");
    }
    actix_web::rt::spawn(keep_up(metrics));
    Ok(server.run())
}
