//! The admin listener, separate from the proxy port: health, readiness, Prometheus metrics,
//! the token-protected JSON API operators and the CLI use to inspect and resolve claims and
//! decide approvals, and the console (the same operations in a browser).

pub mod access;
mod approvals;
mod audit;
pub mod cli;
pub mod client;
mod console;
mod freezes;
mod held_cache;
mod keys;
mod listener;
mod live_sessions;
pub mod session;
mod throttle;
mod traffic;

use std::convert::Infallible;
use std::sync::Arc;

use http::{header, HeaderValue, Method, Request, Response, StatusCode};
use hyper::body::Incoming;

use self::access::{Access, Principal, Role};
use self::audit::Audit;
pub use self::listener::serve;
use self::session::Sessions;
use self::throttle::Throttle;
use self::traffic::Traffic;
use crate::config::{Config, ConfigError};
use crate::http::body::{full, Body};
use crate::http::problem::Problem;
use crate::idempotency::record::State;
use crate::outbound::announce::Webhook;
use crate::proxy::App;

/// The admin listener's settings, checked when the config is.
#[derive(Clone)]
pub struct AdminSettings {
    access: Access,
    sessions: Arc<Sessions>,
    list_limit: usize,
    login_per_minute: u32,
    tls: Option<Arc<rustls::ServerConfig>>,
    /// Where audit events go besides the log (the `[approvals] webhook`); set when the app
    /// is built, since the sender needs the runtime.
    pub audit_hook: Option<Arc<Webhook>>,
}

impl std::fmt::Debug for AdminSettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdminSettings")
            .field("tokens", &self.access.enabled())
            .field("sessions", &self.sessions)
            .field("list_limit", &self.list_limit)
            .field("tls", &self.tls.is_some())
            .finish_non_exhaustive()
    }
}

impl AdminSettings {
    pub fn from_config(config: &Config) -> Result<AdminSettings, ConfigError> {
        let admin = &config.admin;
        if admin.list_limit == 0 {
            return Err(config.invalid("admin.list_limit", "must be greater than 0"));
        }
        if admin.login_attempts_per_minute == 0 {
            return Err(config.invalid("admin.login_attempts_per_minute", "must be greater than 0"));
        }
        Ok(AdminSettings {
            access: Access::from_config(config)?,
            sessions: Arc::new(Sessions::from_config(config)?),
            list_limit: admin.list_limit,
            login_per_minute: admin.login_attempts_per_minute,
            tls: listener::tls_config(config)?,
            audit_hook: None,
        })
    }

    /// Whether some admin token may approve parked payments: without one, nobody can.
    pub fn can_approve(&self) -> bool {
        self.access.can_approve()
    }
}

/// What `check-config` and `serve` warn about in `[admin]` and `server.admin_listen`.
pub fn warnings(config: &Config) -> Vec<String> {
    let mut out = Vec::new();
    let Some(admin_listen) = &config.server.admin_listen else {
        return out;
    };
    let host = |a: &str| a.parse::<std::net::SocketAddr>().map(|s| s.ip()).ok();
    if let (Some(a), Some(w)) = (host(admin_listen), host(&config.server.listen)) {
        if a == w || a.is_unspecified() || w.is_unspecified() {
            out.push(format!(
                "server.admin_listen ({admin_listen}) shares an interface with server.listen ({}): workers that reach the proxy can reach the admin listener and the console; bind it to an address only operators reach",
                config.server.listen
            ));
        }
    }
    let admin = &config.admin;
    if admin.session_key_env.is_none()
        && admin.session_key_file.is_none()
        && (!admin.tokens.is_empty() || admin.token_sha256.is_some())
    {
        out.push("admin.session_key_env / admin.session_key_file is not set: console sessions are signed with a key made up at start-up, so a login holds on this process only and ends when it restarts; give every replica the same key".into());
    }
    if admin.tls_cert.is_none() && !admin.behind_tls && !admin.tokens.is_empty() {
        if let Some(a) = host(admin_listen) {
            if !a.is_loopback() {
                out.push(format!("the admin listener ({admin_listen}) is not loopback and has no admin.tls_cert: tokens and session cookies cross the network in clear (set admin.tls_cert and admin.tls_key, or admin.behind_tls when TLS ends in front of it)"));
            }
        }
    }
    out
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
    access: Access,
    sessions: Arc<Sessions>,
    list_limit: usize,
    reload: Option<Arc<dyn Reload>>,
    throttle: Throttle,
    audit: Audit,
    traffic: Arc<Traffic>,
    held: held_cache::HeldCache,
    tls: Option<Arc<rustls::ServerConfig>>,
}

impl Admin {
    pub fn new(app: Arc<App>, settings: AdminSettings) -> Admin {
        let traffic = Arc::new(Traffic::default());
        Admin {
            traffic,
            app,
            access: settings.access,
            sessions: settings.sessions,
            list_limit: settings.list_limit,
            reload: None,
            throttle: Throttle::new(settings.login_per_minute),
            audit: Audit::new(settings.audit_hook),
            held: held_cache::HeldCache::default(),
            tls: settings.tls,
        }
    }

    /// Serves `POST /v1/reload` with `reload`.
    pub fn with_reload(mut self, reload: Arc<dyn Reload>) -> Admin {
        self.reload = Some(reload);
        self
    }

    pub fn key_api_enabled(&self) -> bool {
        self.access.enabled()
    }

    /// Whether the listener speaks HTTPS.
    pub fn tls(&self) -> bool {
        self.tls.is_some()
    }

    /// The holder of the `Authorization: Bearer <token>` the request carries (compared by
    /// hash in constant time, so neither the token nor its length leaks).
    fn bearer(&self, req: &Request<Incoming>) -> Result<Principal, Box<Response<Body>>> {
        if !self.access.enabled() {
            return Err(Box::new(problem(
                StatusCode::FORBIDDEN,
                "admin-api-disabled",
                "The key API is disabled: set the token in the environment variable named by admin.token_env (default IDEMPROXY_ADMIN_TOKEN), admin.token_sha256, or [[admin.tokens]].",
            )));
        }
        let given = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| {
                let (scheme, token) = v.trim().split_once(' ')?;
                scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
            });
        match given.and_then(|t| self.access.check(t)) {
            Some(who) => Ok(who),
            None => {
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
    }

    async fn handle(
        self: Arc<Self>,
        req: Request<Incoming>,
        peer: std::net::IpAddr,
    ) -> Result<Response<Body>, Infallible> {
        let path = req.uri().path().to_string();
        let resp = match (req.method().clone(), path.as_str()) {
            (Method::GET, "/healthz") => json(StatusCode::OK, &serde_json::json!({"status": "ok"})),
            (Method::GET, "/readyz") => self.readyz().await,
            (Method::GET, "/metrics") => self.metrics().await,
            (_, "/" | "/console") => console::redirect("/console/"),
            (_, p) if p.starts_with("/console/") => console::handle(&self, req, peer).await,
            (Method::POST, "/v1/reload") => match self.bearer(&req) {
                Err(resp) => *resp,
                Ok(who) => match require(&who, Role::Operator) {
                    Err(resp) => *resp,
                    Ok(()) => self.reload().await,
                },
            },
            (_, "/v1/reload") => problem(
                StatusCode::METHOD_NOT_ALLOWED,
                "method-not-allowed",
                "Use POST.",
            ),
            (_, p) if p.starts_with("/v1/keys") => match self.bearer(&req) {
                Err(resp) => *resp,
                Ok(who) => keys::handle(&self, &who, req).await,
            },
            (_, p) if p.starts_with("/v1/approvals") => match self.bearer(&req) {
                Err(resp) => *resp,
                Ok(who) => approvals::handle(&self, &who, req).await,
            },
            (_, p) if p.starts_with("/v1/freezes") => match self.bearer(&req) {
                Err(resp) => *resp,
                Ok(who) => freezes::handle(&self, &who, req).await,
            },
            (_, p) if p.starts_with("/v1/sessions") => match self.bearer(&req) {
                Err(resp) => *resp,
                Ok(who) => live_sessions::handle(&self, &who, req).await,
            },
            (_, "/healthz" | "/readyz" | "/metrics") => problem(
                StatusCode::METHOD_NOT_ALLOWED,
                "method-not-allowed",
                "Use GET.",
            ),
            _ => problem(
                StatusCode::NOT_FOUND,
                "not-found",
                "Admin endpoints: /healthz, /readyz, /metrics, /console/, /v1/keys (show, resolve, reconcile), /v1/approvals (approve, deny), /v1/freezes (freeze, unfreeze), /v1/sessions (end), /v1/reload.",
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
        // From the store's index of pending approvals: a scrape never loads a parked body.
        let now = self.app.claims.clock().now_ms();
        if let Ok(pending) = self.app.spend.store().pending(now).await {
            self.app.metrics.approvals_pending.set(pending.len() as i64);
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

/// `Ok` when `who` may do what `needs` may; a 403 naming both otherwise.
fn require(who: &Principal, needs: Role) -> Result<(), Box<Response<Body>>> {
    if who.role >= needs {
        return Ok(());
    }
    Err(Box::new(problem(
        StatusCode::FORBIDDEN,
        "admin-forbidden",
        &format!(
            "The token {} has the {} role; this needs {}.",
            who.name,
            who.role.as_str(),
            needs.as_str()
        ),
    )))
}
