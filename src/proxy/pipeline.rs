//! The pipeline of one protected request, top to bottom:
//! `route → key → scope → fingerprint → claim → forward → settle → respond`.
//! (The route was chosen by `dispatch`.)

use std::borrow::Cow;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{header, HeaderValue, Request, Response, Uri, Version};
use hyper::body::Incoming;

use super::body::{full, read_limited, stream, Body, ReadError};
use super::body_key;
use super::dispatch::DEFAULT_TENANT;
use super::headers::{for_upstream, strip_hop_by_hop};
use super::receipt;
use super::upstream::{UpstreamClient, UpstreamError};
use crate::app::App;
use crate::config::{MissingKey, OnInFlight};
use crate::idempotency::claims::{Acquired, Claim, Claims, Settle, Settled};
use crate::idempotency::policy::Policy;
use crate::idempotency::record::{Receipt, Token};
use crate::idempotency::settle::{settle, Outcome, Settlement};
use crate::idempotency::template::{Rendered, RequestView};
use crate::idempotency::{fingerprint, key, scope};
use crate::metrics::{InFlight, Metrics, RequestOutcome};
use crate::problem::{ClaimAfterFailure, ProxyError};
use crate::routes::Route;

/// Runs a request the route protects (its method is one of the route's).
pub async fn run(
    app: &App,
    route: &Arc<Route>,
    req: Request<Incoming>,
    upstream_uri: Uri,
    tenant: &str,
) -> Response<Body> {
    let started = Instant::now();
    let mut trace = Trace::default();
    let resp = match protect(app, route, req, upstream_uri, tenant, &mut trace).await {
        Ok(resp) => resp,
        Err(e) => {
            trace.outcome.get_or_insert(outcome_of(&e));
            e.into_response()
        }
    };
    trace.finish(app, route, tenant, started, resp.status().as_u16());
    resp
}

/// What one protected request did: its one log line and its request count. The scope stands
/// in for the key: it is a hash, so neither the key nor the caller's credentials are logged.
#[derive(Default)]
struct Trace {
    scope: Option<String>,
    outcome: Option<RequestOutcome>,
    upstream_status: Option<u16>,
    /// Forward and settle together (the upstream call alone is in the metrics).
    forward: Option<Duration>,
}

impl Trace {
    fn finish(self, app: &App, route: &Route, tenant: &str, started: Instant, status: u16) {
        let outcome = self.outcome.unwrap_or(RequestOutcome::Rejected);
        app.metrics.request(&route.name, outcome);
        tracing::info!(
            route = %route.name,
            %tenant,
            scope = %self.scope.as_deref().unwrap_or("-"),
            outcome = %outcome.as_str(),
            status,
            upstream_status = self.upstream_status,
            forward_ms = self.forward.map(|d| d.as_millis() as u64),
            total_ms = started.elapsed().as_millis() as u64,
            "protected request"
        );
    }
}

fn outcome_of(e: &ProxyError) -> RequestOutcome {
    match e {
        ProxyError::KeyReused => RequestOutcome::Mismatch,
        ProxyError::InFlight { .. } => RequestOutcome::Conflict,
        ProxyError::OutcomeUnknown { .. } | ProxyError::DuplicateRejected { .. } => {
            RequestOutcome::Unknown
        }
        ProxyError::Upstream { claim, .. } => match claim {
            ClaimAfterFailure::Released => RequestOutcome::Released,
            ClaimAfterFailure::Unknown | ClaimAfterFailure::Unsettled => RequestOutcome::Unknown,
            ClaimAfterFailure::None => RequestOutcome::Passthrough,
        },
        _ => RequestOutcome::Rejected,
    }
}

async fn protect(
    app: &App,
    route: &Arc<Route>,
    req: Request<Incoming>,
    upstream_uri: Uri,
    tenant: &str,
    trace: &mut Trace,
) -> Result<Response<Body>, ProxyError> {
    // key, from the client's header; a route with no other source of keys decides now.
    let client_key = key::from_headers(req.headers(), &route.key_header)?;
    if client_key.is_none() && route.key_template.is_none() {
        match route.missing_key {
            MissingKey::Forward => {
                trace.outcome = Some(RequestOutcome::Passthrough);
                return Ok(super::passthrough::forward(&route.client, req, upstream_uri).await);
            }
            MissingKey::Reject => {
                return Err(ProxyError::MissingKey {
                    header: route.key_header.to_string(),
                })
            }
            MissingKey::Derive => {}
        }
    }

    // The body is read only now, so a request refused above never has to send it
    // (hyper answers `Expect: 100-continue` on the first poll).
    let (parts, body) = req.into_parts();
    if declared_length(&parts.headers).is_some_and(|n| n > app.max_body_bytes as u64) {
        return Err(ProxyError::BodyTooLarge {
            limit: app.max_body_bytes,
        });
    }
    let body = read_limited(body, app.max_body_bytes)
        .await
        .map_err(|e| match e {
            ReadError::TooLarge(limit) => ProxyError::BodyTooLarge { limit },
            ReadError::Failed(e) => {
                ProxyError::BadRequest(format!("the request body could not be read: {e}"))
            }
        })?;

    // key, derived: the route's template over the request, else its missing-key policy.
    let keyed = match client_key {
        Some(k) => Keyed::Key(k),
        None => match derive_key(route, &parts, &upstream_uri, &body)? {
            Some(keyed) => keyed,
            None => {
                trace.outcome = Some(RequestOutcome::Passthrough);
                return forward_unprotected(route, &parts, upstream_uri, body).await;
            }
        },
    };

    // fingerprint: what exactly is being asked.
    let path_and_query = upstream_uri
        .path_and_query()
        .map(|p| p.as_str())
        .unwrap_or("/");
    let content_type = parts
        .headers
        .get(header::CONTENT_TYPE)
        .map(HeaderValue::as_bytes);
    let fingerprint =
        fingerprint::fingerprint(parts.method.as_str(), path_and_query, content_type, &body);

    // The key passed down, in the provider's form (`forward_key_limits.fit`). A fingerprint
    // key lasts only the dedup window and is never passed down: the provider would keep
    // deduplicating it far longer (Stripe: 24 h) and answer a deliberate later payment with
    // the earlier one's response. Each execution gets a fresh provider key instead, and with
    // no provider-side dedup to lean on, an ambiguous outcome is held.
    let (key, mut passed_down, policy) = match keyed {
        Keyed::Key(k) => {
            let down = route.forward_key_limits.fit(&provider_key(tenant, &k));
            (k, down, Cow::Borrowed(&route.policy))
        }
        Keyed::Fingerprint => (
            // The space keeps it apart from every client key (those are visible ASCII only),
            // so a client can never land on a derived claim, which runs under another policy.
            format!("fingerprint {fingerprint}"),
            route
                .forward_key_limits
                .fit(&format!("fp-{}", Token::random().as_str())),
            Cow::Owned(Policy {
                retention: route.dedup_window,
                honours_key: false,
                ..route.policy.clone()
            }),
        ),
    };
    let policy: &Policy = &policy;

    // scope: who is asking, through which route, with which key.
    let credentials = scope::credential_fingerprint(&parts.headers, &route.credential_headers);
    let scope = scope::scope(
        &app.namespace,
        tenant,
        &route.name,
        &route.upstream.host,
        &credentials,
        &key,
    );
    trace.scope = Some(scope.clone());

    // The forwarded body: the client's bytes, plus the key for a provider that takes it in
    // a body field. Refused before anything is claimed.
    let upstream_body = match &route.forward_key_field {
        Some(field) => {
            let (with_key, own) =
                body_key::inject(&body, field, &passed_down).map_err(ProxyError::MalformedBody)?;
            // The client set the field itself: that is the provider's key for this request.
            if let Some(own) = own {
                passed_down = own;
            }
            with_key
        }
        None => body,
    };

    // claim: a duplicate in flight gets 409, or waits for the first to settle.
    let acquired = match policy.on_in_flight {
        OnInFlight::Conflict => {
            app.claims
                .acquire(&scope, &fingerprint, &route.name, policy)
                .await
        }
        OnInFlight::Wait => {
            app.claims
                .acquire_waiting(
                    &scope,
                    &fingerprint,
                    &route.name,
                    policy,
                    route.wait_timeout,
                )
                .await
        }
    };
    let claim = match acquired {
        Ok(Acquired::Execute(claim)) => claim,
        Ok(Acquired::Replay(receipt)) => {
            trace.outcome = Some(RequestOutcome::Replayed);
            return Ok(receipt::respond(&receipt, true));
        }
        Ok(Acquired::Mismatch) => return Err(ProxyError::KeyReused),
        Ok(Acquired::InFlight { retry_after }) => return Err(ProxyError::InFlight { retry_after }),
        Ok(Acquired::Held { retry_after }) => {
            return Err(ProxyError::OutcomeUnknown { retry_after })
        }
        Err(e) if policy.fail_open && e.is_unreachable() => {
            tracing::warn!(route = %route.name, error = %e, "store unavailable; forwarding unprotected (fail_open)");
            trace.outcome = Some(RequestOutcome::Passthrough);
            let request = upstream_request(
                &parts,
                upstream_uri,
                upstream_body,
                route,
                Some(&passed_down),
            );
            let (resp_parts, resp_body) =
                call(&route.client, request, route, app.max_receipt_bytes)
                    .await
                    .map_err(|error| ProxyError::Upstream {
                        error,
                        claim: ClaimAfterFailure::None,
                    })?;
            let mut resp = receipt::respond(&receipt::from_response(&resp_parts, resp_body), false);
            resp.headers_mut().insert(
                "x-idemproxy-warning",
                HeaderValue::from_static("unprotected: store unavailable"),
            );
            return Ok(resp);
        }
        Err(e) => return Err(ProxyError::StoreUnavailable(e)),
    };

    // forward and settle, in a task of their own: a client that hangs up must neither cancel
    // a call the provider may be executing nor leave its claim unsettled, and shutdown waits
    // for the task.
    let request = upstream_request(
        &parts,
        upstream_uri,
        upstream_body,
        route,
        Some(&passed_down),
    );
    let task = forward_and_settle(
        app.claims.clone(),
        route.clone(),
        policy.clone(),
        claim,
        request,
        passed_down,
        app.max_receipt_bytes,
        app.metrics.clone(),
    );
    let forward_started = Instant::now();
    let (result, settled, duplicate) =
        app.claims
            .spawn_tracked(task)
            .await
            .map_err(|e| ProxyError::Upstream {
                error: UpstreamError::Failed(format!("the forwarding task stopped: {e}")),
                claim: ClaimAfterFailure::Unsettled,
            })?;
    trace.forward = Some(forward_started.elapsed());
    trace.upstream_status = result.as_ref().ok().map(|r| r.status);
    trace.outcome = Some(match settled {
        ClaimAfterFailure::None => RequestOutcome::Forwarded,
        ClaimAfterFailure::Released => RequestOutcome::Released,
        ClaimAfterFailure::Unknown | ClaimAfterFailure::Unsettled => RequestOutcome::Unknown,
    });
    if let Some(note) = duplicate {
        return Err(ProxyError::DuplicateRejected { note });
    }

    // respond: the provider's real answer, built exactly as a replay would be.
    match result {
        Ok(receipt) => Ok(receipt::respond(&receipt, false)),
        Err(error) => Err(ProxyError::Upstream {
            error,
            claim: settled,
        }),
    }
}

fn declared_length(headers: &http::HeaderMap) -> Option<u64> {
    headers
        .get(header::CONTENT_LENGTH)?
        .to_str()
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// How a protected request is keyed.
enum Keyed {
    /// The client's key, or the one the route's template derived.
    Key(String),
    /// `missing_key = "derive"`: the request's own fingerprint, for the dedup window.
    Fingerprint,
}

/// A key for a request without one: the route's template, else its missing-key policy.
/// `None`: forward it unprotected.
fn derive_key(
    route: &Route,
    parts: &http::request::Parts,
    uri: &Uri,
    body: &[u8],
) -> Result<Option<Keyed>, ProxyError> {
    let missing = |field: Option<String>| match route.missing_key {
        MissingKey::Forward => Ok(None),
        MissingKey::Reject => {
            let header = route.key_header.to_string();
            Err(match field {
                Some(field) => ProxyError::MissingKeyField { header, field },
                None => ProxyError::MissingKey { header },
            })
        }
        MissingKey::Derive => Ok(Some(Keyed::Fingerprint)),
    };
    let Some(template) = &route.key_template else {
        return missing(None);
    };
    let path = uri
        .path()
        .strip_prefix(route.upstream.base_path.as_str())
        .unwrap_or(uri.path());
    let view = RequestView {
        method: parts.method.as_str(),
        path,
        headers: &parts.headers,
        body,
    };
    match template.render(&view) {
        Ok(Rendered::Key(k)) => Ok(Some(Keyed::Key(k))),
        Ok(Rendered::Missing(field)) => missing(Some(field)),
        Err(e) => Err(ProxyError::MalformedBody(format!(
            "route {}: {e}, so its key template cannot derive a key",
            route.name
        ))),
    }
}

/// The key as the provider gets it, before its limits apply. Outside the default tenant it
/// carries the tenant: tenants sharing one provider account must not have the provider
/// deduplicate one tenant's request against another's and hand over its response.
fn provider_key(tenant: &str, key: &str) -> String {
    if tenant == DEFAULT_TENANT {
        key.to_string()
    } else {
        format!("{tenant}:{key}")
    }
}

/// A request the route's template could not key, on a route that forwards such requests:
/// its body was read already, so it goes down buffered; the response streams back.
async fn forward_unprotected(
    route: &Route,
    parts: &http::request::Parts,
    uri: Uri,
    body: Bytes,
) -> Result<Response<Body>, ProxyError> {
    let request = upstream_request(parts, uri, body, route, None);
    match route.client.send(request).await {
        Ok(resp) => {
            let (mut parts, body) = resp.into_parts();
            strip_hop_by_hop(&mut parts.headers);
            Ok(Response::from_parts(parts, stream(body)))
        }
        Err(error) => Err(ProxyError::Upstream {
            error,
            claim: ClaimAfterFailure::None,
        }),
    }
}

/// The request as the provider gets it: end-to-end headers, the buffered body, and the key
/// (when given) in the provider's own header instead of the client's.
fn upstream_request(
    parts: &http::request::Parts,
    uri: Uri,
    body: Bytes,
    route: &Route,
    key: Option<&str>,
) -> Request<Body> {
    let mut headers = parts.headers.clone();
    for_upstream(&mut headers, true);
    headers.remove(&route.key_header);
    if let (Some(name), Some(key)) = (&route.forward_key_header, key) {
        if let Ok(v) = HeaderValue::from_str(key) {
            headers.insert(name.clone(), v);
        }
    }
    let mut req = Request::new(full(body));
    *req.method_mut() = parts.method.clone();
    *req.uri_mut() = uri;
    // The upstream connection may be HTTP/1.1 or HTTP/2; the client picks, from 1.1.
    *req.version_mut() = Version::HTTP_11;
    *req.headers_mut() = headers;
    req
}

/// One upstream call under the route's total deadline, reading the whole response.
async fn call(
    client: &UpstreamClient,
    req: Request<Body>,
    route: &Route,
    max_receipt: usize,
) -> Result<(http::response::Parts, Bytes), UpstreamError> {
    let deadline = route.timeout;
    let exchange = async {
        let (parts, body) = client.send(req).await?.into_parts();
        let body = read_limited(body, max_receipt).await.map_err(|e| match e {
            ReadError::TooLarge(n) => UpstreamError::ResponseTooLarge(n),
            ReadError::Failed(e) => {
                UpstreamError::Failed(format!("reading the response body: {e}"))
            }
        })?;
        Ok((parts, body))
    };
    tokio::time::timeout(deadline, exchange)
        .await
        .unwrap_or(Err(UpstreamError::Timeout(deadline)))
}

/// Runs `work` while renewing the claim every third of its lease, so a slow provider does
/// not make a live claim look abandoned.
async fn with_lease_renewal<T>(
    claims: &Claims,
    claim: &Claim,
    policy: &Policy,
    work: impl std::future::Future<Output = T>,
) -> T {
    let renew = async {
        let every = policy.lease / 3;
        loop {
            tokio::time::sleep(every).await;
            match claims.renew(claim, policy).await {
                Ok(true) => {}
                Ok(false) => {
                    tracing::warn!(scope = %claim.scope, "lost the claim while the upstream call runs; its settle will be refused");
                    break;
                }
                Err(e) => {
                    tracing::warn!(scope = %claim.scope, error = %e, "could not renew the claim lease")
                }
            }
        }
        std::future::pending::<T>().await
    };
    tokio::select! {
        biased;
        out = work => out,
        never = renew => never,
    }
}

/// forward (renewing the claim's lease while the provider works), then settle, fenced by the
/// claim's token. A provider's "key already used" answer is never a receipt: the operation
/// exists, but this is not its response, so the claim is UNKNOWN and the note says so.
// The task owns everything it uses ('static), hence the argument list.
#[allow(clippy::too_many_arguments)]
async fn forward_and_settle(
    claims: Arc<Claims>,
    route: Arc<Route>,
    policy: Policy,
    claim: Claim,
    request: Request<Body>,
    passed_down: String,
    max_receipt: usize,
    metrics: Arc<Metrics>,
) -> (
    Result<Receipt, UpstreamError>,
    ClaimAfterFailure,
    Option<String>,
) {
    // Counted here, in the task, so a call whose client hung up still shows.
    let _in_flight = InFlight::start(&metrics);
    let upstream_started = Instant::now();
    let result = with_lease_renewal(
        &claims,
        &claim,
        &policy,
        call(&route.client, request, &route, max_receipt),
    )
    .await
    .map(|(parts, body)| receipt::from_response(&parts, body));
    metrics.upstream(&route.name, upstream_started.elapsed().as_secs_f64());
    let outcome = match &result {
        Ok(receipt) => Outcome::Responded(receipt.status),
        Err(e) if e.may_have_been_sent() => Outcome::FailedAfterSend,
        Err(_) => Outcome::FailedBeforeSend,
    };
    let duplicate = match (&result, &route.duplicate) {
        (Ok(r), Some(d)) if d.matches(r.status, &r.body) => Some(format!(
            "the provider answered {} (code {}): it already has an operation with the key `{passed_down}` passed down, from an earlier attempt. Look it up with {}",
            r.status,
            d.code,
            d.lookup_hint.replace("{key}", &passed_down)
        )),
        _ => None,
    };
    let settlement = match duplicate {
        Some(_) => Settlement::Unknown,
        None => settle(outcome, &policy),
    };
    let how = match (settlement, &result) {
        (Settlement::Commit, Ok(receipt)) => Settle::Commit(receipt.clone()),
        (Settlement::Release, _) | (Settlement::Commit, Err(_)) => Settle::Release,
        (Settlement::Unknown, result) => {
            Settle::Unknown(duplicate.clone().unwrap_or_else(|| match result {
                Ok(receipt) => format!(
                    "the provider answered {} and does not deduplicate on keys",
                    receipt.status
                ),
                Err(e) => format!("{e} after the request may have reached the provider"),
            }))
        }
    };
    let scope = claim.scope.clone();
    // What the settle was meant to do, for the client's answer: `how` itself moves into it.
    let meant = match &how {
        Settle::Commit(_) => ClaimAfterFailure::None,
        Settle::Release => ClaimAfterFailure::Released,
        Settle::Unknown(_) => ClaimAfterFailure::Unknown,
    };
    let settled = claims.settle_or_retry(claim, how, policy).await;
    if settled == Settled::NotOurs {
        tracing::warn!(%scope, "the claim was no longer ours at settle time; nothing overwritten");
    }
    tracing::debug!(route = %route.name, ?outcome, ?settled, "settled");
    let after = match settled {
        Settled::Done => meant,
        Settled::NotOurs | Settled::Unconfirmed => ClaimAfterFailure::Unsettled,
    };
    (result, after, duplicate)
}
