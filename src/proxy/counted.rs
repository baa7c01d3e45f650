//! Objects whose creation spend control counted (a Stripe PaymentIntent): their later steps
//! (confirm, capture) cost nothing more, for the same account on the same route. The proxy
//! keeps a marker per object in the claim store, under a scope no client key can name (a
//! NUL byte leads it), read before a step is priced and written before the creating
//! request's answer reaches the client, so an SDK's next call already finds it.

use std::borrow::Cow;
use std::sync::Arc;
use std::time::Duration;

use super::json_at;
use super::App;
use crate::idempotency::claims::Executed;
use crate::idempotency::outcome::Outcome;
use crate::idempotency::record::{Record, State};
use crate::idempotency::store::{Clock, Expiry, Store, StoreError};
use crate::outbound::upstream::UpstreamError;
use crate::proxy::error::ProxyError;
use crate::request::Request;
use crate::routes::{Route, RouteSpend};
use crate::spend::cost::Pricing;

/// Whether a step of an object (confirming a PaymentIntent) names one this route counted at
/// its creation, for the same account: then it costs nothing more. The store down: refused.
pub async fn before(
    app: &App,
    route: &Route,
    rules: &RouteSpend,
    view: &Request<'_>,
    account: &str,
) -> Result<bool, ProxyError> {
    let Some(Pricing::Counted { kind, id_segment }) =
        rules.operation(view.method, view.path).map(|o| &o.pricing)
    else {
        return Ok(false);
    };
    let Some(id) = id_in_path(view.path, *id_segment) else {
        return Ok(false);
    };
    let scope = scope(app, route, view.tenant, account, kind, id);
    was_counted(app.claims.store().as_ref(), &scope)
        .await
        .map_err(ProxyError::StoreUnavailable)
}

/// After a counted request that creates an object committed with a 2xx answer: marks the
/// object counted (in the claim's own task, before the client hears of it), so its later
/// steps cost nothing more; for as long as the creating operation's receipt. Best effort: an
/// object left unmarked is only priced as unknown later, never undercounted.
pub struct Marking {
    store: Arc<dyn Store>,
    clock: Clock,
    route: Arc<Route>,
    namespace: String,
    tenant: String,
    account: String,
    kind: &'static str,
    at: &'static str,
    keep: Duration,
}

impl Marking {
    /// `None` unless the operation creates an object the route counts.
    pub fn new(
        app: &App,
        route: &Arc<Route>,
        rules: &RouteSpend,
        view: &Request<'_>,
        account: &str,
        keep: Duration,
    ) -> Option<Marking> {
        let (kind, at) = rules.operation(view.method, view.path)?.records?;
        Some(Marking {
            store: app.claims.store().clone(),
            clock: app.claims.clock(),
            route: route.clone(),
            namespace: app.namespace.clone(),
            tenant: view.tenant.to_string(),
            account: account.to_string(),
            kind,
            at,
            keep,
        })
    }

    /// Marks what the executed request created, if it did.
    pub async fn settled(self, executed: &Executed<UpstreamError>) {
        let Ok(receipt) = &executed.result else {
            return;
        };
        if !matches!(executed.outcome, Outcome::Committed) || !(200..300).contains(&receipt.status)
        {
            return;
        }
        let Some(id) = id_in_answer(&receipt.body, self.at) else {
            return;
        };
        let (route, kind) = (&self.route, self.kind);
        let scope = route
            .place(&self.namespace, &self.tenant)
            .scope(&self.account, &marker_key(kind, &id));
        let now = self.clock.now_ms();
        let written = record(
            self.store.as_ref(),
            &scope,
            &route.name,
            kind,
            now,
            self.keep,
        );
        if let Err(e) = written.await {
            tracing::warn!(route = %route.name, %kind, error = %e, "could not mark an object counted: its later steps will be priced as unknown");
        }
    }
}

/// The key a marker is kept under: no client key can name it (a NUL byte leads it).
fn marker_key(kind: &str, id: &str) -> String {
    format!("\0counted {kind} {id}")
}

/// The marker's scope: the object, within the route, upstream, tenant and account.
fn scope(app: &App, route: &Route, tenant: &str, account: &str, kind: &str, id: &str) -> String {
    route
        .place(&app.namespace, tenant)
        .scope(account, &marker_key(kind, id))
}

/// The id of the object a step names: path segment `at` (from 0).
fn id_in_path(path: &str, at: usize) -> Option<&str> {
    path.split('/').filter(|s| !s.is_empty()).nth(at)
}

/// The id of the object an answer made: the JSON field at the dotted `at` (`payment.id`).
fn id_in_answer<'b>(body: &'b [u8], at: &str) -> Option<Cow<'b, str>> {
    json_at::string_at(body, at).filter(|s| !s.is_empty() && s.len() <= 255)
}

/// Whether the object was counted at its creation.
async fn was_counted(store: &dyn Store, scope: &str) -> Result<bool, StoreError> {
    Ok(store
        .get(scope)
        .await?
        .is_some_and(|r| r.state == State::Committed))
}

/// Marks the object counted, for `keep`.
async fn record(
    store: &dyn Store,
    scope: &str,
    route: &str,
    kind: &str,
    now_ms: u64,
    keep: Duration,
) -> Result<(), StoreError> {
    let marker = Record::marker(
        route,
        now_ms,
        format!("a {kind} whose creation spend control counted"),
        None,
    );
    store
        .insert_if_absent(scope, &marker, Expiry::After(keep))
        .await
        .map(|_| ())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_come_from_the_path_and_the_answer() {
        assert_eq!(
            id_in_path("/v1/payment_intents/pi_1/confirm", 2),
            Some("pi_1")
        );
        assert_eq!(id_in_path("/v1/payment_intents", 2), None);
        assert_eq!(
            id_in_answer(br#"{"payment":{"id":"p_9"}}"#, "payment.id"),
            Some("p_9".into())
        );
        assert_eq!(id_in_answer(br#"{"id":7}"#, "id"), None);
        assert_eq!(id_in_answer(b"not json", "id"), None);
    }
}
