//! The approvals API: payments parked by spend control, and a person's decision on each
//! (who decided and why are recorded). A decision wakes the parked request at once, on this
//! proxy or any other sharing the store.

use base64::Engine as _;
use http::{Method, Request, Response, StatusCode};
use hyper::body::Incoming;
use serde::Deserialize;

use super::{json, problem, Admin};
use crate::http::body::{read_limited, Body};
use crate::spend::gate::wake_key;
use crate::spend::port::{Approval, ApprovalState};

const MAX_REQUEST: usize = 64 * 1024;
const MAX_LIST: usize = 1000;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Decision {
    id: String,
    /// Who decides (a name or an email): recorded with the decision.
    by: String,
    #[serde(default)]
    reason: Option<String>,
}

pub(super) async fn handle(admin: &Admin, req: Request<Incoming>) -> Response<Body> {
    let (method, path) = (req.method().clone(), req.uri().path().to_string());
    let query = req.uri().query().unwrap_or("").to_string();
    match (method, path.as_str()) {
        (Method::GET, "/v1/approvals") => list(admin, &query).await,
        (Method::POST, "/v1/approvals/approve") => match decision(req).await {
            Ok(d) => decide(admin, d, ApprovalState::Approved).await,
            Err(resp) => resp,
        },
        (Method::POST, "/v1/approvals/deny") => match decision(req).await {
            Ok(d) => decide(admin, d, ApprovalState::Denied).await,
            Err(resp) => resp,
        },
        _ => problem(
            StatusCode::NOT_FOUND,
            "not-found",
            "Approvals API: GET /v1/approvals?state=pending, POST /v1/approvals/approve, POST /v1/approvals/deny.",
        ),
    }
}

async fn decision(req: Request<Incoming>) -> Result<Decision, Response<Body>> {
    let bytes = read_limited(req.into_body(), MAX_REQUEST)
        .await
        .map_err(|e| bad(&format!("cannot read the request body: {e}")))?;
    let d: Decision = serde_json::from_slice(&bytes).map_err(|e| {
        bad(&format!(
            "the request body is not valid: {e} (send {{\"id\", \"by\", \"reason\"}})"
        ))
    })?;
    if d.by.trim().is_empty() {
        return Err(bad(
            "by: say who decides (a name or an email); it is recorded",
        ));
    }
    Ok(d)
}

fn bad(detail: &str) -> Response<Body> {
    problem(StatusCode::BAD_REQUEST, "bad-request", detail)
}

async fn list(admin: &Admin, query: &str) -> Response<Body> {
    let gate = &admin.app.spend;
    let mut wanted = "pending".to_string();
    let mut limit = 100;
    for (k, v) in query.split('&').filter_map(|kv| kv.split_once('=')) {
        match k {
            "state" => wanted = v.to_ascii_lowercase(),
            "limit" => match v.parse::<usize>() {
                Ok(n) if n > 0 => limit = n.min(MAX_LIST),
                _ => return bad("limit must be a positive number"),
            },
            _ => {}
        }
    }
    if !["pending", "approved", "denied", "expired", "all"].contains(&wanted.as_str()) {
        return bad("state must be pending, approved, denied, expired or all");
    }
    let now = admin.app.claims.clock().now_ms();
    match gate.store().approvals(MAX_LIST).await {
        Ok(all) => {
            let shown: Vec<_> = all
                .iter()
                .filter(|a| wanted == "all" || state_name(a, now) == wanted)
                .take(limit)
                .map(|a| view(a, now))
                .collect();
            json(
                StatusCode::OK,
                &serde_json::json!({"state": wanted, "count": shown.len(), "approvals": shown}),
            )
        }
        Err(e) => store_error(e),
    }
}

async fn decide(admin: &Admin, d: Decision, to: ApprovalState) -> Response<Body> {
    let gate = &admin.app.spend;
    let now = admin.app.claims.clock().now_ms();
    let current = match gate.store().approval(&d.id).await {
        Ok(Some(a)) => a,
        Ok(None) => {
            return problem(
                StatusCode::NOT_FOUND,
                "approval-not-found",
                &format!(
                    "No approval {}: check the id `idemproxy approvals list` printed.",
                    d.id
                ),
            )
        }
        Err(e) => return store_error(e),
    };
    if current.state != ApprovalState::Pending || current.expired(now) {
        return problem(
            StatusCode::CONFLICT,
            "approval-decided",
            &format!(
                "Approval {} is {}{}: nothing was changed.",
                d.id,
                state_name(&current, now),
                current
                    .decided_by
                    .as_deref()
                    .map(|b| format!(" (by {b})"))
                    .unwrap_or_default()
            ),
        );
    }
    let mut decided = current.clone();
    decided.state = to;
    decided.decided_by = Some(d.by.trim().to_string());
    decided.reason = d.reason.filter(|r| !r.trim().is_empty());
    decided.decided_ms = Some(now);
    match gate.store().update_approval(&decided).await {
        Ok(true) => {
            let event = if to == ApprovalState::Approved { "approved" } else { "denied" };
            admin.app.claims.announce(&wake_key(&decided.id));
            admin.app.metrics.approval(&decided.route, event);
            tracing::info!(approval = %decided.id, route = %decided.route, run = %decided.run, amount = %decided.amount, by = %d.by, reason = decided.reason.as_deref(), "{event}");
            json(StatusCode::OK, &view(&decided, now))
        }
        Ok(false) => problem(
            StatusCode::CONFLICT,
            "approval-decided",
            &format!("Approval {} changed while deciding (someone else decided it): nothing was changed; list it again.", d.id),
        ),
        Err(e) => store_error(e),
    }
}

fn state_name(a: &Approval, now: u64) -> &'static str {
    if a.expired(now) {
        return "expired";
    }
    match a.state {
        ApprovalState::Pending => "pending",
        ApprovalState::Approved => "approved",
        ApprovalState::Denied => "denied",
    }
}

/// What an approver sees: the payment and the request body — never a credential (none is
/// kept).
fn view(a: &Approval, now: u64) -> serde_json::Value {
    let body = match std::str::from_utf8(&a.body) {
        Ok(text) => serde_json::json!({"text": text}),
        Err(_) => {
            serde_json::json!({"base64": base64::engine::general_purpose::STANDARD.encode(&a.body)})
        }
    };
    serde_json::json!({
        "id": a.id,
        "state": state_name(a, now),
        "route": a.route,
        "tenant": a.tenant,
        "run": a.run,
        "amount": a.amount,
        "request": format!("{} {}", a.method, a.path),
        "body": body,
        "why": a.why,
        "created_ms": a.created_ms,
        "expires_ms": a.expires_ms,
        "decided_by": a.decided_by,
        "reason": a.reason,
        "decided_ms": a.decided_ms,
    })
}

fn store_error(e: crate::idempotency::store::StoreError) -> Response<Body> {
    problem(
        StatusCode::SERVICE_UNAVAILABLE,
        "store-unavailable",
        &format!("{e}. Nothing was changed; try again."),
    )
}
