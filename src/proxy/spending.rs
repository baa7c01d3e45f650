//! The HTTP side of spend control: reads a money-moving request's cost and run, asks the
//! spend gate, and renders its refusals in the provider's own error shape, so an SDK raises
//! an error that says what happened instead of a generic failure.

use http::{header, HeaderMap, HeaderValue, Method, Response, StatusCode};

use crate::http::body::{full, Body};
use crate::http::problem::{Problem, ERROR_HEADER};
use crate::providers::ErrorShape;
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
            SpendError::Refused(Refusal::Pending { .. }) => "Nothing was forwarded yet: retry with the same idempotency key; once approved, the retry executes it (once).",
            SpendError::Refused(Refusal::Denied { .. }) => "Nothing was forwarded, and every retry gets this answer.",
            SpendError::Refused(Refusal::Mismatch { .. }) => "Nothing was forwarded: use a new idempotency key for a different payment.",
            SpendError::Refused(Refusal::Store(_)) => "Nothing was forwarded; retry later.",
        }
    }

    fn retry_after(&self) -> Option<std::time::Duration> {
        match self {
            SpendError::Refused(Refusal::Pending { retry_after, .. }) => Some(*retry_after),
            _ => None,
        }
    }

    /// The refusal as the route's provider writes errors.
    pub fn into_response(self, shape: ErrorShape) -> Response<Body> {
        let problem = Problem::new(
            self.status(),
            self.slug(),
            format!("{self}. {}", self.advice()),
        )
        .retry_after(self.retry_after());
        let retry = matches!(self, SpendError::Refused(Refusal::Pending { .. }));
        shaped(problem, shape, retry)
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

/// A problem in the provider's error shape (problem+json for none). The slug stays in
/// `X-Idemproxy-Error` and the provider's error code, so either can be matched on.
fn shaped(problem: Problem, shape: ErrorShape, retry: bool) -> Response<Body> {
    let code = format!("idemproxy_{}", problem.slug.replace('-', "_"));
    let message = &problem.detail;
    let status = problem.status;
    let body = match shape {
        ErrorShape::Problem => return problem.into_response(),
        ErrorShape::Stripe => serde_json::json!({"error": {
            "type": if status == StatusCode::CONFLICT { "api_error" } else { "invalid_request_error" },
            "code": code, "message": message}}),
        ErrorShape::Square => serde_json::json!({"errors": [{
            "category": "INVALID_REQUEST_ERROR", "code": code.to_uppercase(), "detail": message}]}),
        ErrorShape::Adyen => serde_json::json!({
            "status": status.as_u16(), "errorCode": code, "message": message, "errorType": "validation"}),
        ErrorShape::PayPal => serde_json::json!({
            "name": code.to_uppercase(), "message": message, "debug_id": problem.slug}),
        ErrorShape::Alpaca => {
            serde_json::json!({"code": 40_000_000 + u64::from(status.as_u16()) * 10_000, "message": message})
        }
    };
    let retry_after = problem.retry_after;
    let mut resp = Response::new(full(body.to_string()));
    *resp.status_mut() = status;
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    h.insert(ERROR_HEADER, HeaderValue::from_static(problem.slug));
    if let Some(after) = retry_after {
        h.insert(
            header::RETRY_AFTER,
            HeaderValue::from(after.as_millis().div_ceil(1000).max(1) as u64),
        );
    }
    if shape == ErrorShape::Stripe {
        // stripe-python and stripe-node obey this over their own rules: retry a pending
        // approval (each retry waits again), never a refusal.
        h.insert(
            "stripe-should-retry",
            HeaderValue::from_static(if retry { "true" } else { "false" }),
        );
    }
    resp
}

impl crate::spend::gate::SpendEvents for crate::metrics::Metrics {
    fn refused(&self, route: &str, cap: crate::spend::port::CapName) {
        self.spend_refused(route, cap.as_str());
    }

    fn approval(&self, route: &str, event: &'static str) {
        crate::metrics::Metrics::approval(self, route, event);
    }
}
