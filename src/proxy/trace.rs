//! What one protected request did, gathered as the pipeline runs: its one log line and its
//! request count (`Trace::finish`).

use std::time::{Duration, Instant};

use crate::idempotency::claims::{Executed, Recorded};
use crate::idempotency::outcome::Outcome;
use crate::identity::Identified;
use crate::metrics::RequestOutcome;
use crate::outbound::upstream::UpstreamError;
use crate::proxy::error::ProxyError;
use crate::proxy::App;
use crate::routes::Route;

/// What one protected request did: its one log line and its request count. The scope stands
/// in for the key: it is a hash, so neither the key nor the caller's credentials are logged.
#[derive(Default)]
pub struct Trace {
    pub scope: Option<String>,
    pub outcome: Option<RequestOutcome>,
    pub key_source: Option<&'static str>,
    pub operation: Option<String>,
    pub unprotected: Option<String>,
    /// What spend control decided (reserved, or why not).
    pub spend: Option<String>,
    pub upstream_status: Option<u16>,
    /// Forward and settle together (the upstream call alone is in the metrics).
    pub forward: Option<Duration>,
}

impl Trace {
    pub fn identified(&mut self, id: &Identified) {
        self.key_source = Some(id.derived.identity.source().as_str());
        self.operation = id.operation.clone();
    }

    pub fn settled(&mut self, executed: &Executed<UpstreamError>) {
        self.upstream_status = executed.result.as_ref().ok().map(|r| r.status);
        self.outcome = Some(match (&executed.outcome, executed.recorded) {
            (_, Recorded::NotOurs | Recorded::Unconfirmed) => RequestOutcome::Unknown,
            (Outcome::Committed | Outcome::Declined, _) => RequestOutcome::Forwarded,
            (Outcome::Released | Outcome::Awaiting(_), _) => RequestOutcome::Released,
            (Outcome::Unknown(_) | Outcome::Duplicate(_), _) => RequestOutcome::Unknown,
        });
    }

    pub fn finish(self, app: &App, route: &Route, tenant: &str, started: Instant, status: u16) {
        let outcome = self.outcome.unwrap_or(RequestOutcome::Rejected);
        app.metrics.request(&route.name, outcome);
        if outcome == RequestOutcome::Unprotected {
            // Identification says why it had no key; otherwise the store was down (fail_open).
            let reason = if self.unprotected.is_some() {
                "no_key"
            } else {
                "store_unavailable"
            };
            app.metrics.unprotected(&route.name, reason);
        }
        super::log_line::Line {
            route: &route.name,
            tenant,
            scope: self.scope.as_deref().unwrap_or("-"),
            key_source: self.key_source.unwrap_or("-"),
            operation: self.operation.as_deref().unwrap_or("-"),
            outcome: outcome.as_str(),
            unprotected: self.unprotected.as_deref(),
            spend: self.spend.as_deref(),
            status,
            upstream_status: self.upstream_status,
            forward_ms: self.forward.map(|d| d.as_millis() as u64),
            total_ms: started.elapsed().as_millis() as u64,
        }
        .log();
    }
}

pub fn outcome_of(e: &ProxyError) -> RequestOutcome {
    match e {
        ProxyError::KeyReused => RequestOutcome::Mismatch,
        ProxyError::InFlight { .. } => RequestOutcome::Conflict,
        ProxyError::OutcomeUnknown { .. } | ProxyError::DuplicateRejected { .. } => {
            RequestOutcome::Unknown
        }
        ProxyError::Upstream { claim, .. } => match claim {
            None => RequestOutcome::Unprotected,
            Some((_, Recorded::NotOurs | Recorded::Unconfirmed)) => RequestOutcome::Unknown,
            Some((Outcome::Unknown(_) | Outcome::Duplicate(_), _)) => RequestOutcome::Unknown,
            Some(_) => RequestOutcome::Released,
        },
        _ => RequestOutcome::Rejected,
    }
}
