//! `CONNECT host:port` (HTTPS_PROXY): a host a route covers is intercepted, so its requests go
//! through the idempotency pipeline; any other host gets a blind tunnel, or a 403 by config.

use std::sync::Arc;
use std::time::Duration;

use http::{Request, Response};
use hyper::body::Incoming;

use self::policy::{ConnectError, Target};
use super::connection::ConnectionSlot;
use crate::config::UnknownHosts;
use crate::http::body::{empty, Body};
use crate::metrics::RequestOutcome;
use crate::proxy::App;

pub mod intercept;
pub mod policy;
pub mod tunnel;

/// How long a blind tunnel may take to reach its target.
const DIAL_TIMEOUT: Duration = Duration::from_secs(10);

/// Answers a CONNECT from `tenant` (already authenticated by the caller). On success the
/// answer is an empty 200 and the connection is handed, once upgraded, to the interceptor or
/// a blind tunnel.
pub async fn handle(app: Arc<App>, req: Request<Incoming>, tenant: String) -> Response<Body> {
    // Kept for the log line: clients show only the status of a refused CONNECT, never its
    // body, so the log and the metric are where its reason can be seen.
    let authority = req.uri().to_string();
    match open(app.clone(), req, tenant.clone()).await {
        Ok(resp) => resp,
        Err(e) => {
            refused(&app, &e, &authority, &tenant);
            e.into_response()
        }
    }
}

fn refused(app: &App, e: &ConnectError, authority: &str, tenant: &str) {
    app.metrics.request("-", RequestOutcome::Rejected);
    app.metrics.connect_refused(e.reason());
    tracing::info!(
        authority,
        tenant,
        reason = e.reason(),
        status = e.status().as_u16(),
        "CONNECT refused: {e}. {}",
        e.advice()
    );
}

async fn open(
    app: Arc<App>,
    req: Request<Incoming>,
    tenant: String,
) -> Result<Response<Body>, ConnectError> {
    let target = Target::parse(req.uri())?;
    // Held by the tunnel for its whole life (see `ConnectionSlot`).
    let slot = req.extensions().get::<ConnectionSlot>().cloned();
    let policy = &app.connect;
    if !policy.ports.contains(&target.port) {
        return Err(ConnectError::PortNotAllowed(target.port));
    }
    if let Some(route) = app.routes.by_host(&target.host, target.port) {
        if policy.leaves.is_none() {
            return Err(ConnectError::NoCa {
                route: route.name.clone(),
                host: target.to_string(),
            });
        }
        // The run the proxy user names (`tenant.run`) belongs to every request in the tunnel.
        let run = crate::auth::run_of_proxy_user(req.headers());
        let upgrade = hyper::upgrade::on(req);
        let serve = intercept::serve(app.clone(), target, upgrade, tenant, run);
        tokio::spawn(async move {
            let _slot = slot;
            serve.await
        });
        return Ok(established());
    }
    // A protected host on a port its route does not name is refused, not tunnelled past
    // the route.
    if let Some(route) = app.routes.on_other_port(&target.host, target.port) {
        return Err(ConnectError::RouteOnOtherPort {
            route: route.name.clone(),
            host: target.host.clone(),
            route_port: route.port.unwrap_or(target.port),
        });
    }
    if policy.unknown_hosts == UnknownHosts::Deny {
        return Err(ConnectError::HostDenied(target.to_string()));
    }
    // Dial before answering, so an unreachable target is a 502 the client can read rather
    // than a tunnel that closes at once.
    let upstream = tunnel::dial(&target, DIAL_TIMEOUT, &app.egress).await?;
    app.metrics.request("-", RequestOutcome::Tunnel);
    let run = tunnel::run(
        hyper::upgrade::on(req),
        upstream,
        target,
        policy.tunnel_idle_timeout,
    );
    tokio::spawn(async move {
        let _slot = slot;
        run.await
    });
    Ok(established())
}

/// `200` with no body and no framing headers (RFC 9110 §9.3.6).
fn established() -> Response<Body> {
    Response::new(empty())
}
