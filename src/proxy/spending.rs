//! The HTTP side of spend control: reads a money-moving request's cost and run, asks the
//! spend gate, and says why it refused (`ProxyError::Spend`, rendered like every refusal in
//! the route's provider's error shape by `proxy::error`).

use http::{HeaderMap, Method, StatusCode};

use crate::request::Request;
use crate::routes::{Route, RouteSpend, RunSource};
use crate::spend::budget::{PriceError, Spender};
use crate::spend::gate::{Ask, Gate, Refusal, Ticket};

/// The run the proxy user named on the CONNECT that opened an intercepted tunnel: requests
/// inside it carry no `Proxy-Authorization` of their own.
#[derive(Debug, Clone)]
pub struct TunnelRun(pub std::sync::Arc<str>);

/// Longest run id accepted (from the proxy user or a header).
pub const MAX_RUN_LEN: usize = 64;

/// Why a money-moving request was not forwarded.
#[derive(Debug, thiserror::Error)]
pub enum SpendError {
    #[error("{0}")]
    Price(#[from] PriceError),
    #[error("the run id {0}")]
    Run(String),
    #[error(transparent)]
    Refused(#[from] Refusal),
}

impl SpendError {
    pub fn status(&self) -> StatusCode {
        match self {
            SpendError::Price(_) | SpendError::Run(_) => StatusCode::BAD_REQUEST,
            SpendError::Refused(Refusal::OverCap { .. } | Refusal::Denied { .. }) => {
                StatusCode::FORBIDDEN
            }
            SpendError::Refused(Refusal::Pending { .. } | Refusal::Mismatch { .. }) => {
                StatusCode::CONFLICT
            }
            SpendError::Refused(Refusal::Store(_)) => StatusCode::SERVICE_UNAVAILABLE,
        }
    }

    pub fn slug(&self) -> &'static str {
        match self {
            SpendError::Price(PriceError::Ambiguous(_)) => "ambiguous-request",
            SpendError::Price(_) => "amount-invalid",
            SpendError::Run(_) => "run-invalid",
            SpendError::Refused(Refusal::OverCap { .. }) => "spend-cap-exceeded",
            SpendError::Refused(Refusal::Pending { .. }) => "approval-pending",
            SpendError::Refused(Refusal::Denied { .. }) => "approval-denied",
            SpendError::Refused(Refusal::Mismatch { .. }) => "approval-mismatch",
            SpendError::Refused(Refusal::Store(_)) => "store-unavailable",
        }
    }

    pub fn advice(&self) -> &'static str {
        match self {
            SpendError::Price(PriceError::Ambiguous(_)) => "Nothing was forwarded: the proxy and the provider could read two amounts from this request, so it does not go out. Send each field once, in the body.",
            SpendError::Price(_) => "Nothing was forwarded: a capped route counts every payment, so one whose amount cannot be read does not go out.",
            SpendError::Run(_) => "Nothing was forwarded. Run ids are 1-64 letters, digits, '.', '_', ':' or '-'.",
            SpendError::Refused(Refusal::OverCap { .. }) => "Nothing was forwarded. An operator can raise the cap in the route's [routes.spend].",
            SpendError::Refused(Refusal::Pending { .. }) => "Nothing was sent. Ask again later with the same request: once a person approves it, it goes out, once.",
            SpendError::Refused(Refusal::Denied { .. }) => "Nothing was forwarded, and every retry gets this answer.",
            SpendError::Refused(Refusal::Mismatch { .. }) => "Nothing was forwarded: use a new idempotency key for a different payment.",
            SpendError::Refused(Refusal::Store(_)) => "Nothing was forwarded; retry later.",
        }
    }

    pub fn retry_after(&self) -> Option<std::time::Duration> {
        match self {
            SpendError::Refused(Refusal::Pending { retry_after, .. }) => Some(*retry_after),
            _ => None,
        }
    }
}

/// Whether a request moves money on this route; its budget and run then apply.
pub fn applies<'r>(route: &'r Route, method: &Method, path: &str) -> Option<&'r RouteSpend> {
    route.spend.as_ref().filter(|s| s.covers(method, path))
}

/// Admits a money-moving request through the spend gate (caps, approvals, reservation).
pub async fn admit(
    gate: &Gate,
    route: &Route,
    spend: &RouteSpend,
    view: &Request<'_>,
    tunnel: Option<&TunnelRun>,
    scope: &str,
) -> Result<Ticket, SpendError> {
    let price = spend.budget.price(view)?;
    let run = run_of(spend, view.headers, tunnel)?.unwrap_or_else(|| view.tenant.to_string());
    let ask = Ask {
        scope,
        who: Spender {
            route: &route.name,
            tenant: view.tenant,
            run: &run,
        },
        price,
        method: view.method.as_str(),
        path: view.path,
        body: view.body,
        retention: route.policy.retention,
    };
    Ok(gate.admit(&spend.budget, &ask).await?)
}

/// The request's run, from the first source that has one.
fn run_of(
    spend: &RouteSpend,
    headers: &HeaderMap,
    tunnel: Option<&TunnelRun>,
) -> Result<Option<String>, SpendError> {
    for source in &spend.run_from {
        let found = match source {
            RunSource::ProxyUser => {
                crate::auth::run_of_proxy_user(headers).or_else(|| tunnel.map(|t| t.0.to_string()))
            }
            RunSource::Header(name) => match headers.get(name) {
                Some(v) => Some(
                    v.to_str()
                        .map_err(|_| SpendError::Run(format!("in {name} is not text")))?
                        .trim()
                        .to_string(),
                ),
                None => None,
            },
        };
        if let Some(run) = found {
            check_run(&run)?;
            return Ok(Some(run));
        }
    }
    Ok(None)
}

fn check_run(run: &str) -> Result<(), SpendError> {
    if run.is_empty() || run.len() > MAX_RUN_LEN {
        return Err(SpendError::Run(format!(
            "is {} bytes; it must be 1 to {MAX_RUN_LEN}",
            run.len()
        )));
    }
    if !run
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b"._:-".contains(&b))
    {
        return Err(SpendError::Run(format!(
            "`{run}` holds a character other than letters, digits, '.', '_', ':' or '-'"
        )));
    }
    Ok(())
}

impl crate::spend::gate::SpendEvents for crate::metrics::Metrics {
    fn refused(&self, route: &str, cap: crate::spend::port::CapName) {
        self.spend_refused(route, cap.as_str());
    }

    fn approval(&self, route: &str, event: &'static str) {
        crate::metrics::Metrics::approval(self, route, event);
    }
}
