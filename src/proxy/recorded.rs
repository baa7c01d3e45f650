//! Objects whose amount a tool call through the proxy recorded (a price made by
//! `create_price`), so a later call that names one and carries no amount of its own
//! (`create_payment_link(price, quantity)`) can be priced. As with `counted` markers, a record
//! is kept in the claim store under a scope no client key can name (a NUL byte leads it), per
//! route, upstream, tenant, account and object id, for as long as the creating call's
//! receipt; it is written before the creating call's answer reaches the client when the
//! server answers with one JSON body, and just after its last event when it streams. An
//! object the proxy did not see created has no record: a call naming it stays unpriced.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::idempotency::claims::Executed;
use crate::idempotency::outcome::Outcome;
use crate::idempotency::record::{Receipt, Record, State};
use crate::idempotency::store::{Clock, Expiry, Store, StoreError};
use crate::identity::scope::Place;
use crate::mcp::recorded::{PriceFrom, RecordedObject, Records};
use crate::outbound::upstream::UpstreamError;
use crate::routes::RouteSpend;
use crate::spend::budget::PriceError;
use crate::spend::money::{Money, Unit};

/// The record's scope: the object, within the route, upstream, tenant and account.
pub fn scope(place: &Place<'_>, account: &str, kind: &str, id: &str) -> String {
    place.scope(account, &format!("\0recorded {kind} {id}"))
}

/// What a record keeps (the body of its receipt): the object's amount as its creating call's
/// result wrote it, not yet money.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Kept {
    kind: String,
    id: String,
    amount: String,
    currency: String,
    unit: String,
}

/// Where a tool call's result is recorded once it is settled: everything but the id the
/// result names (the scope's parts, owned: the record is written in the claim's own task).
pub struct Keeping {
    store: Arc<dyn Store>,
    clock: Clock,
    namespace: String,
    tenant: String,
    route: String,
    upstream_host: String,
    account: String,
    rule: Records,
    arguments: Value,
    keep: Duration,
}

impl Keeping {
    /// `None` when the tool records nothing.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        store: &Arc<dyn Store>,
        clock: Clock,
        place: &Place<'_>,
        account: &str,
        rule: Option<&Records>,
        arguments: &Value,
        keep: Duration,
    ) -> Option<Keeping> {
        Some(Keeping {
            store: store.clone(),
            clock,
            namespace: place.namespace.to_string(),
            tenant: place.tenant.to_string(),
            route: place.route.to_string(),
            upstream_host: place.upstream_host.to_string(),
            account: account.to_string(),
            rule: rule?.clone(),
            arguments: arguments.clone(),
            keep,
        })
    }

    /// After the call settled: a committed result that names the object records it. Best
    /// effort: an object left unrecorded is only unpriced later, never undercounted.
    pub async fn settled(self, executed: &Executed<UpstreamError>) {
        let Ok(receipt) = &executed.result else {
            return;
        };
        if !matches!(executed.outcome, Outcome::Committed) || receipt.status != 200 {
            return;
        }
        let Some(made) = self.rule.read(&self.arguments, &receipt.body) else {
            tracing::debug!(route = %self.route, kind = %self.rule.kind, "a recording tool's result named no object: nothing recorded");
            return;
        };
        let place = Place {
            namespace: &self.namespace,
            tenant: &self.tenant,
            route: &self.route,
            upstream_host: &self.upstream_host,
        };
        let scope = scope(&place, &self.account, &made.kind, &made.id);
        let now = self.clock.now_ms();
        if let Err(e) = keep(
            self.store.as_ref(),
            &scope,
            &self.route,
            &made,
            now,
            self.keep,
        )
        .await
        {
            tracing::warn!(route = %self.route, kind = %made.kind, error = %e, "could not record an object's amount: calls naming it will be unpriced");
        }
    }
}

/// Records what a call made, for `keep`. An object already recorded keeps its first record.
pub async fn keep(
    store: &dyn Store,
    scope: &str,
    route: &str,
    made: &RecordedObject,
    now_ms: u64,
    keep: Duration,
) -> Result<(), StoreError> {
    let kept = Kept {
        kind: made.kind.clone(),
        id: made.id.clone(),
        amount: made.amount.clone(),
        currency: made.currency.clone(),
        unit: made.unit.clone(),
    };
    let body = serde_json::to_vec(&kept).unwrap_or_default();
    let record = Record::marker(
        route,
        now_ms,
        format!(
            "the amount of a {} ({} {} in {} units) a tool call through this route created",
            made.kind, made.amount, made.currency, made.unit
        ),
        Some(Receipt {
            status: 200,
            headers: vec![("content-type".into(), "application/json".into())],
            body: Bytes::from(body),
        }),
    );
    store
        .insert_if_absent(scope, &record, Expiry::After(keep))
        .await
        .map(|_| ())
}

/// What a capped tool call priced from a recorded object asks for: the object's amount
/// (times the call's quantity), or `None` when the proxy recorded no such object for this
/// account (the call is then unpriced). A store that cannot answer refuses the call.
pub async fn asked(
    store: &dyn Store,
    place: &Place<'_>,
    account: &str,
    spend: &RouteSpend,
    from: &PriceFrom,
    arguments: &Value,
) -> Result<Option<Money>, Looked> {
    let Some(id) = from.id(arguments) else {
        return Ok(None);
    };
    let times = from
        .times(arguments)
        .map_err(|m| Looked::Price(PriceError::Unreadable(m)))?;
    let Some(record) = store
        .get(&scope(place, account, &from.kind, &id))
        .await
        .map_err(Looked::Store)?
    else {
        return Ok(None);
    };
    let kept = record
        .body
        .receipt
        .filter(|_| record.state == State::Committed)
        .and_then(|r| serde_json::from_slice::<Kept>(&r.body).ok());
    let Some(kept) = kept.filter(|k| k.kind == from.kind && k.id == id) else {
        return Ok(None);
    };
    let unit = if kept.unit == "major" {
        Unit::Major
    } else {
        Unit::Minor
    };
    spend
        .budget
        .recorded(&kept.amount, unit, &kept.currency, times.as_deref())
        .map(Some)
        .map_err(Looked::Price)
}

/// Why a recorded object could not price a call.
#[derive(Debug, thiserror::Error)]
pub enum Looked {
    #[error(transparent)]
    Store(StoreError),
    #[error(transparent)]
    Price(PriceError),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_of_two_accounts_or_kinds_never_share_a_scope() {
        let place = Place {
            namespace: "idem",
            tenant: "t",
            route: "stripe-mcp",
            upstream_host: "mcp.stripe.com",
        };
        let a = scope(&place, "acct-a", "price", "price_1");
        assert_ne!(a, scope(&place, "acct-b", "price", "price_1"));
        assert_ne!(a, scope(&place, "acct-a", "invoice", "price_1"));
        // Not the scope a client key naming the same words would claim.
        assert_ne!(a, place.scope("acct-a", "recorded price price_1"));
        assert_ne!(
            a,
            // counted.rs's marker for an object of the same kind and id.
            place.scope("acct-a", "\0counted price price_1")
        );
    }
}
