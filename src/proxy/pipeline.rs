//! The pipeline of one protected request, top to bottom:
//! `route → key → scope → fingerprint → claim → forward → settle → respond`.
//! (The route was chosen by `dispatch`.)

use std::sync::Arc;

use bytes::Bytes;
use http::{header, HeaderValue, Request, Response, Uri, Version};
use hyper::body::Incoming;

use super::body::{full, read_limited, Body, ReadError};
use super::headers::for_upstream;
use super::receipt;
use super::upstream::{UpstreamClient, UpstreamError};
use crate::app::App;
use crate::config::{MissingKey, OnInFlight};
use crate::idempotency::claims::{Acquired, Claim, Claims};
use crate::idempotency::policy::Policy;
use crate::idempotency::record::Receipt;
use crate::idempotency::settle::{settle, Outcome, Settlement};
use crate::idempotency::{fingerprint, key, scope};
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
    match protect(app, route, req, upstream_uri, tenant).await {
        Ok(resp) => resp,
        Err(e) => e.into_response(),
    }
}

async fn protect(
    app: &App,
    route: &Route,
    req: Request<Incoming>,
    upstream_uri: Uri,
    tenant: &str,
) -> Result<Response<Body>, ProxyError> {
    // key
    let Some(key) = key::from_headers(req.headers(), &route.key_header)? else {
        return match route.missing_key {
            MissingKey::Forward => {
                Ok(super::passthrough::forward(&route.client, req, upstream_uri).await)
            }
            MissingKey::Reject => Err(ProxyError::MissingKey {
                header: route.key_header.to_string(),
            }),
        };
    };

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

    // claim
    let policy = &route.policy;
    let claim = match app
        .claims
        .acquire(&scope, &fingerprint, &route.name, policy)
        .await
    {
        Ok(Acquired::Execute(claim)) => claim,
        Ok(Acquired::Replay(receipt)) => return Ok(receipt::respond(&receipt, true)),
        Ok(Acquired::Mismatch) => return Err(ProxyError::KeyReused),
        Ok(Acquired::InFlight { retry_after }) => {
            return match policy.on_in_flight {
                OnInFlight::Conflict | OnInFlight::Wait => {
                    Err(ProxyError::InFlight { retry_after })
                }
            }
        }
        Ok(Acquired::Held { retry_after }) => {
            return Err(ProxyError::OutcomeUnknown { retry_after })
        }
        Err(e) if policy.fail_open => {
            tracing::warn!(route = %route.name, error = %e, "store unavailable; forwarding unprotected (fail_open)");
            let request = upstream_request(&parts, upstream_uri, body, route, &key);
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

    // forward, renewing the claim's lease while the provider works.
    let request = upstream_request(&parts, upstream_uri, body, route, &key);
    let result = with_lease_renewal(
        &app.claims,
        &claim,
        policy,
        call(&route.client, request, route, app.max_receipt_bytes),
    )
    .await;

    // settle, fenced by the claim's token.
    let result = result.map(|(parts, body)| receipt::from_response(&parts, body));
    let outcome = match &result {
        Ok(receipt) => Outcome::Responded(receipt.status),
        Err(e) if e.may_have_been_sent() => Outcome::FailedAfterSend,
        Err(_) => Outcome::FailedBeforeSend,
    };
    let settled = settle_claim(
        &app.claims,
        &claim,
        policy,
        settle(outcome, policy),
        &result,
    )
    .await;
    tracing::info!(route = %route.name, ?outcome, ?settled, "settled");

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

/// The request as the provider gets it: end-to-end headers, the buffered body, and the key
/// in the provider's own header instead of the client's.
fn upstream_request(
    parts: &http::request::Parts,
    uri: Uri,
    body: Bytes,
    route: &Route,
    key: &str,
) -> Request<Body> {
    let mut headers = parts.headers.clone();
    for_upstream(&mut headers, true);
    headers.remove(&route.key_header);
    if let Some(name) = &route.forward_key_header {
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

async fn settle_claim(
    claims: &Claims,
    claim: &Claim,
    policy: &Policy,
    settlement: Settlement,
    result: &Result<Receipt, UpstreamError>,
) -> ClaimAfterFailure {
    let (done, settled) = match (settlement, result) {
        (Settlement::Commit, Ok(receipt)) => (
            claims.commit(claim, receipt.clone(), policy).await,
            ClaimAfterFailure::None,
        ),
        (Settlement::Release, _) | (Settlement::Commit, Err(_)) => {
            (claims.release(claim).await, ClaimAfterFailure::Released)
        }
        (Settlement::Unknown, _) => {
            let why = match result {
                Ok(receipt) => format!(
                    "the provider answered {} and does not deduplicate on keys",
                    receipt.status
                ),
                Err(e) => format!("{e} after the request may have reached the provider"),
            };
            (
                claims.mark_unknown(claim, why, policy).await,
                ClaimAfterFailure::Unknown,
            )
        }
    };
    match done {
        Ok(true) => settled,
        Ok(false) => {
            tracing::warn!(scope = %claim.scope, "the claim was no longer ours at settle time; nothing overwritten");
            ClaimAfterFailure::Unsettled
        }
        Err(e) => {
            tracing::error!(scope = %claim.scope, error = %e, "could not settle the claim; it becomes UNKNOWN when its lease runs out");
            ClaimAfterFailure::Unsettled
        }
    }
}
