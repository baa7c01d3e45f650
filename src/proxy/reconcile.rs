//! A retry of a held operation (its outcome UNKNOWN), on a route that can ask its provider:
//! asked about at the provider with the retry's own credentials before the retry is held.
//! Found → the provider's answer is the receipt; not found → this retry executes it; unclear,
//! or credentials other than the held attempt's → still held.

use std::sync::Arc;

use http::HeaderName;

use super::App;
use crate::idempotency::claims::{ClaimRequest, HeldClaim, Reconciled, Verdict};
use crate::idempotency::policy::Policy;
use crate::identity::provider_key::KeyField;
use crate::identity::scope::Scoped;
use crate::outbound::lookup::{self, Asking, Lookup};
use crate::proxy::error::ProxyError;
use crate::request::Request;
use crate::routes::Route;

/// What the claim keeps of an attempt's credentials (a hash), to compare a retry's with.
pub fn credentials(route: &Route, req: &Request<'_>) -> String {
    lookup::credentials(req, &key_headers(route))
}

/// Reconciles the held claim `held` of `op` for `retry`, whose claim would be `claim`.
pub async fn run(
    app: &App,
    route: &Route,
    held: HeldClaim,
    retry: &Request<'_>,
    op: &Scoped,
    claim: &ClaimRequest<'_>,
    policy: &Arc<Policy>,
) -> Result<Reconciled, ProxyError> {
    let Some(lookup) = &route.lookup else {
        return Ok(Reconciled::Held { retry_after: None });
    };
    // The lookup asks with this retry's credentials: only when they are the held attempt's
    // own (hashed alike), else a retry with other credentials could be told "not found" and
    // execute the operation again. Otherwise it stays held.
    if held.lookup_credentials() != Some(credentials(route, retry).as_str()) {
        tracing::info!(route = %route.name, scope = %op.scope, "a retry with other credentials than the held attempt's: not looked up, still held");
        return Ok(Reconciled::Held { retry_after: None });
    }
    // Asked about under the key the held attempt passed down (its derivation's, its attempt).
    let key = route
        .passing()
        .for_attempt(retry.tenant, op, held.scope(), held.attempt());
    let verdict = ask(
        app,
        route,
        lookup,
        retry,
        key.as_str(),
        held.lookup_target(),
    )
    .await;
    let reconciled = app
        .claims
        .reconcile(held, verdict, claim, policy)
        .await
        .map_err(ProxyError::StoreUnavailable)?;
    match &reconciled {
        Reconciled::Replay(_) => {
            app.metrics.unknown_resolved(&route.name, "lookup");
            tracing::info!(route = %route.name, scope = %op.scope, "a lookup found the held operation at the provider: its answer is the receipt");
        }
        Reconciled::Execute(_) => {
            app.metrics.unknown_resolved(&route.name, "lookup");
            tracing::info!(route = %route.name, scope = %op.scope, "a lookup found no trace of the held operation: this retry executes it");
        }
        Reconciled::Held { .. } | Reconciled::Mismatch => {}
    }
    Ok(reconciled)
}

/// Asks the provider, with the retry's request, whether the attempt that passed down `key`
/// happened.
async fn ask(
    app: &App,
    route: &Route,
    lookup: &Lookup,
    retry: &Request<'_>,
    key: &str,
    target: Option<&str>,
) -> Verdict {
    let asking = Asking {
        request: retry,
        key,
        target,
    };
    let key_headers = key_headers(route);
    let verdict = lookup
        .ask(
            &*route.client,
            |target| route.upstream_uri(target).ok(),
            &asking,
            &key_headers,
            route.timeout,
            app.max_receipt_bytes,
        )
        .await;
    let seen = match &verdict {
        Verdict::Found(_) => "found",
        Verdict::NotFound => "not_found",
        Verdict::Unclear(_) => "unclear",
    };
    app.metrics.lookup(&route.name, seen);
    verdict
}

/// The headers that carry an idempotency key on this route: never a credential.
fn key_headers(route: &Route) -> Vec<&HeaderName> {
    let mut headers = vec![&route.identity.key_header];
    if let Some(KeyField::Header(h)) = &route.pass_key {
        headers.push(h);
    }
    headers
}
