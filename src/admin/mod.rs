//! The admin listener, separate from the proxy port: health, readiness, Prometheus metrics,
//! and the token-protected key API operators use to inspect and resolve claims.

mod approvals;
pub mod cli;
pub mod client;
mod keys;

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use http::{header, HeaderValue, Method, Request, Response, StatusCode};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;
use tokio::net::TcpListener;

use crate::config::{Config, ConfigError};
use crate::http::body::{full, Body};
use crate::http::problem::Problem;
use crate::idempotency::record::State;
use crate::proxy::App;

/// The admin listener's settings, checked when the config is.
#[derive(Debug, Clone)]
pub struct AdminSettings {
    /// SHA-256 of the bearer token; `None`: the key API is disabled.
    token_hash: Option<[u8; 32]>,
    list_limit: usize,
}

impl AdminSettings {
    pub fn from_config(config: &Config) -> Result<AdminSettings, ConfigError> {
        let admin = &config.admin;
        let token_hash = match &admin.token_sha256 {
            Some(h) => Some(
                hex::decode(h.trim())
                    .ok()
                    .and_then(|b| <[u8; 32]>::try_from(b).ok())
                    .ok_or_else(|| {
                        config.invalid("admin.token_sha256", "must be 64 hex digits (a SHA-256)")
                    })?,
            ),
            None => std::env::var(&admin.token_env)
                .ok()
                .filter(|t| !t.is_empty())
                .map(|t| Sha256::digest(t.as_bytes()).into()),
        };
        if admin.list_limit == 0 {
            return Err(config.invalid("admin.list_limit", "must be greater than 0"));
        }
        Ok(AdminSettings {
            token_hash,
            list_limit: admin.list_limit,
        })
    }

    /// Whether the admin API has a token: without one the key and approvals API is off.
    pub fn has_token(&self) -> bool {
        self.token_hash.is_some()
    }
}

/// Re-reads the config file. `serve` wires in `crate::reload::Reloader`, which admin cannot
/// name: the reloader builds on the app wiring, and that builds on [`AdminSettings`].
pub trait Reload: Send + Sync {
    /// The names of the routes now in effect, or the problem to answer with.
    fn reload(&self) -> Result<Vec<String>, Problem>;
}

/// Everything the admin handlers need besides the app.
pub struct Admin {
    app: Arc<App>,
    /// SHA-256 of the bearer token; `None`: the key API is disabled.
    token_hash: Option<[u8; 32]>,
    list_limit: usize,
    reload: Option<Arc<dyn Reload>>,
}

impl Admin {
    pub fn new(app: Arc<App>, settings: AdminSettings) -> Admin {
        Admin {
            app,
            token_hash: settings.token_hash,
            list_limit: settings.list_limit,
            reload: None,
        }
    }

    /// Serves `POST /v1/reload` with `reload`.
    pub fn with_reload(mut self, reload: Arc<dyn Reload>) -> Admin {
        self.reload = Some(reload);
        self
    }

    pub fn key_api_enabled(&self) -> bool {
        self.token_hash.is_some()
    }

    /// Constant-time check of `Authorization: Bearer <token>` (hashes compared, so the
    /// length of the token does not leak either).
    fn authorized(&self, req: &Request<Incoming>) -> Result<(), Box<Response<Body>>> {
        let Some(expected) = &self.token_hash else {
            return Err(Box::new(problem(
                StatusCode::FORBIDDEN,
                "admin-api-disabled",
                "The key API is disabled: set the token in the environment variable named by admin.token_env (default IDEMPROXY_ADMIN_TOKEN) or admin.token_sha256.",
            )));
        };
        let given = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| {
                let (scheme, token) = v.trim().split_once(' ')?;
                scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
            });
        let ok = given.is_some_and(|t| {
            let hash: [u8; 32] = Sha256::digest(t.as_bytes()).into();
            hash.ct_eq(expected).unwrap_u8() == 1
        });
        if ok {
            Ok(())
        } else {
            let mut resp = problem(
                StatusCode::UNAUTHORIZED,
                "admin-unauthorized",
                "Send Authorization: Bearer <admin token>.",
            );
            resp.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                HeaderValue::from_static("Bearer realm=\"idemproxy-admin\""),
            );
            Err(Box::new(resp))
        }
    }

    async fn handle(self: Arc<Self>, req: Request<Incoming>) -> Result<Response<Body>, Infallible> {
        let path = req.uri().path().to_string();
        let resp = match (req.method().clone(), path.as_str()) {
            (Method::GET, "/healthz") => json(StatusCode::OK, &serde_json::json!({"status": "ok"})),
            (Method::GET, "/readyz") => self.readyz().await,
            (Method::GET, "/metrics") => self.metrics().await,
            (Method::POST, "/v1/reload") => match self.authorized(&req) {
                Err(resp) => *resp,
                Ok(()) => self.reload().await,
            },
            (_, "/v1/reload") => problem(
                StatusCode::METHOD_NOT_ALLOWED,
                "method-not-allowed",
                "Use POST.",
            ),
            (_, p) if p.starts_with("/v1/keys") => match self.authorized(&req) {
                Err(resp) => *resp,
                Ok(()) => keys::handle(&self, req).await,
            },
            (_, p) if p.starts_with("/v1/approvals") => match self.authorized(&req) {
                Err(resp) => *resp,
                Ok(()) => approvals::handle(&self, req).await,
            },
            (_, "/healthz" | "/readyz" | "/metrics") => problem(
                StatusCode::METHOD_NOT_ALLOWED,
                "method-not-allowed",
                "Use GET.",
            ),
            _ => problem(
                StatusCode::NOT_FOUND,
                "not-found",
                "Admin endpoints: /healthz, /readyz, /metrics, /v1/keys (show, resolve, reconcile), /v1/approvals (approve, deny), /v1/reload.",
            ),
        };
        Ok(resp)
    }

    /// Re-reads the config file off the runtime's threads (it reads files and certificates).
    async fn reload(&self) -> Response<Body> {
        let Some(reload) = self.reload.clone() else {
            return problem(
                StatusCode::SERVICE_UNAVAILABLE,
                "reload-unavailable",
                "This admin listener has no config to reload.",
            );
        };
        match tokio::task::spawn_blocking(move || reload.reload()).await {
            Ok(Ok(routes)) => json(
                StatusCode::OK,
                &serde_json::json!({"reloaded": true, "routes": routes}),
            ),
            Ok(Err(refused)) => refused.into_response(),
            Err(e) => problem(
                StatusCode::INTERNAL_SERVER_ERROR,
                "reload-failed",
                &format!("the reload did not finish: {e}"),
            ),
        }
    }

    /// Ready when the store answers. The CA is loaded (and checked against its key) at
    /// start-up or the proxy does not start; readiness reports whether interception is on.
    async fn readyz(&self) -> Response<Body> {
        // The store is bounded by the store timeout: a stalled one answers `Timeout`.
        let store = self
            .app
            .claims
            .store()
            .ping()
            .await
            .map_err(|e| e.to_string());
        let ready = store.is_ok();
        let checks = serde_json::json!({
            "store": match &store { Ok(()) => "ok".to_string(), Err(e) => e.clone() },
            "ca": if self.app.connect.leaves.is_some() { "loaded" } else { "not configured (CONNECT to routed hosts is refused)" },
        });
        json(
            if ready {
                StatusCode::OK
            } else {
                StatusCode::SERVICE_UNAVAILABLE
            },
            &serde_json::json!({"ready": ready, "checks": checks}),
        )
    }

    async fn metrics(&self) -> Response<Body> {
        // UNKNOWN claims live in the shared store, so every replica reports the same number.
        let list = self
            .app
            .claims
            .store()
            .list(State::Unknown, self.list_limit);
        match list.await {
            Ok(found) => {
                self.app.metrics.unknown_claims.set(found.len() as i64);
            }
            Err(_) => {
                tracing::debug!("cannot count UNKNOWN claims for /metrics; keeping the last value")
            }
        }
        {
            let now = self.app.claims.clock().now_ms();
            if let Ok(all) = self.app.spend.store().approvals(self.list_limit).await {
                let pending = all
                    .iter()
                    .filter(|a| {
                        a.state == crate::spend::port::ApprovalState::Pending && !a.expired(now)
                    })
                    .count();
                self.app.metrics.approvals_pending.set(pending as i64);
            }
        }
        if let Some(leaves) = &self.app.connect.leaves {
            let entries = leaves.entries().await;
            self.app.metrics.cert_cache_entries.set(entries as i64);
        }
        let mut resp = Response::new(full(self.app.metrics.encode()));
        resp.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/openmetrics-text; version=1.0.0; charset=utf-8"),
        );
        resp
    }
}

/// Serves the admin endpoints until the process exits.
pub async fn serve(admin: Arc<Admin>, listener: TcpListener) {
    let mut builder = auto::Builder::new(TokioExecutor::new()).http1_only();
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(Duration::from_secs(10));
    let builder = Arc::new(builder);
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(e) => {
                tracing::warn!(error = %e, "admin accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let admin = admin.clone();
        let builder = builder.clone();
        tokio::spawn(async move {
            let svc = service_fn(move |req| admin.clone().handle(req));
            if let Err(e) = builder.serve_connection(TokioIo::new(stream), svc).await {
                tracing::debug!(error = %e, "admin connection ended with an error");
            }
        });
    }
}

fn json(status: StatusCode, value: &serde_json::Value) -> Response<Body> {
    let mut resp = Response::new(full(value.to_string()));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    resp
}

fn problem(status: StatusCode, slug: &'static str, detail: &str) -> Response<Body> {
    Problem::new(status, slug, detail).into_response()
}
