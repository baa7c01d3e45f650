//! The approvals API: payments parked by spend control, and a person's decision on each
//! (who decided and why are recorded). A decision wakes the parked request at once, on this
//! proxy or any other sharing the store.

use base64::Engine as _;
use http::{Method, Request, Response, StatusCode};
use hyper::body::Incoming;
use serde::Deserialize;

use super::access::{Principal, Role};
use super::{audit, json, problem, Admin};
use crate::http::body::{read_limited, Body};
use crate::http::problem::Problem;
use crate::idempotency::store::StoreError;
use crate::spend::gate::wake_key;
use crate::spend::port::{Approval, ApprovalState, FirstApproval};

const MAX_REQUEST: usize = 64 * 1024;
const MAX_LIST: usize = 1000;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct DecisionBody {
    id: String,
    /// Who decides (a name or an email): recorded with the decision. Needed with the shared
    /// token; a named token decides as its name.
    #[serde(default)]
    by: Option<String>,
    #[serde(default)]
    reason: Option<String>,
}

/// What a decision did.
#[derive(Debug)]
pub(super) enum Decided {
    /// Approved or denied: the parked request hears it now.
    Final(Approval),
    /// Four eyes: the first approval is recorded; a second, different approver must follow.
    FirstOfTwo(Approval),
}

pub(super) async fn handle(
    admin: &Admin,
    who: &Principal,
    req: Request<Incoming>,
) -> Response<Body> {
    let (method, path) = (req.method().clone(), req.uri().path().to_string());
    let query = req.uri().query().unwrap_or("").to_string();
    let to = match (method, path.as_str()) {
        (Method::GET, "/v1/approvals") => return list(admin, &query).await,
        (Method::POST, "/v1/approvals/approve") => ApprovalState::Approved,
        (Method::POST, "/v1/approvals/deny") => ApprovalState::Denied,
        _ => {
            return problem(
                StatusCode::NOT_FOUND,
                "not-found",
                "Approvals API: GET /v1/approvals?state=pending, POST /v1/approvals/approve, POST /v1/approvals/deny.",
            )
        }
    };
    if let Err(resp) = super::require(who, Role::Approver) {
        return *resp;
    }
    let d = match decision(req).await {
        Ok(d) => d,
        Err(resp) => return resp,
    };
    let Some(by) = who.saying(d.by.as_deref()) else {
        return bad("by: say who decides (a name or an email); it is recorded");
    };
    let now = admin.app.claims.clock().now_ms();
    match decide(admin, who, &by, "api", &d.id, d.reason, to).await {
        Ok(Decided::Final(a)) => json(StatusCode::OK, &view(&a, now)),
        Ok(Decided::FirstOfTwo(a)) => json(StatusCode::ACCEPTED, &view(&a, now)),
        Err(p) => p.into_response(),
    }
}

async fn decision(req: Request<Incoming>) -> Result<DecisionBody, Response<Body>> {
    let bytes = read_limited(req.into_body(), MAX_REQUEST)
        .await
        .map_err(|e| bad(&format!("cannot read the request body: {e}")))?;
    serde_json::from_slice(&bytes).map_err(|e| {
        bad(&format!(
            "the request body is not valid: {e} (send {{\"id\", \"by\", \"reason\"}})"
        ))
    })
}

fn bad(detail: &str) -> Response<Body> {
    problem(StatusCode::BAD_REQUEST, "bad-request", detail)
}

/// Up to `limit` approvals, newest first (the store keeps them a day past expiry).
pub(super) async fn all(admin: &Admin) -> Result<Vec<Approval>, StoreError> {
    admin.app.spend.store().approvals(MAX_LIST).await
}

async fn list(admin: &Admin, query: &str) -> Response<Body> {
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
    match all(admin).await {
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
        Err(e) => store_error(e).into_response(),
    }
}

/// Approves or denies approval `id` as `by` (the console and the API both decide here):
/// only a pending, unexpired approval, written over the version read, so two people
/// deciding at once never both win. Above `four_eyes_above` an approval takes two different
/// named approvers. Every decision goes to the audit trail.
pub(super) async fn decide(
    admin: &Admin,
    who: &Principal,
    by: &str,
    via: &'static str,
    id: &str,
    reason: Option<String>,
    to: ApprovalState,
) -> Result<Decided, Problem> {
    let gate = &admin.app.spend;
    let now = admin.app.claims.clock().now_ms();
    let current = match gate.store().approval(id).await {
        Ok(Some(a)) => a,
        Ok(None) => {
            return Err(Problem::new(
                StatusCode::NOT_FOUND,
                "approval-not-found",
                format!("No approval {id}: check the id `idemproxy approvals list` printed."),
            ))
        }
        Err(e) => return Err(store_error(e)),
    };
    if current.state != ApprovalState::Pending || current.expired(now) {
        return Err(Problem::new(
            StatusCode::CONFLICT,
            "approval-decided",
            format!(
                "Approval {id} is {}{}: nothing was changed.",
                state_name(&current, now),
                current
                    .decided_by
                    .as_deref()
                    .map(|b| format!(" (by {b})"))
                    .unwrap_or_default()
            ),
        ));
    }
    let reason = reason
        .map(|r| r.trim().to_string())
        .filter(|r| !r.is_empty());
    let (decided, waits_for_second) =
        decision_on(admin, who, by, &current, reason.clone(), to, now)?;
    match gate.store().update_approval(&decided).await {
        Ok(true) => {}
        Ok(false) => {
            return Err(Problem::new(
                StatusCode::CONFLICT,
                "approval-decided",
                format!("Approval {id} changed while deciding (someone else decided it): nothing was changed; list it again."),
            ))
        }
        Err(e) => return Err(store_error(e)),
    }
    let event = match (waits_for_second, to) {
        (true, _) => "approval.first_approval",
        (false, ApprovalState::Approved) => "approval.approved",
        (false, _) => "approval.denied",
    };
    admin.audit.record(&audit::about_approval(
        event, who, by, via, now, reason, &decided,
    ));
    if waits_for_second {
        return Ok(Decided::FirstOfTwo(decided));
    }
    let label = if to == ApprovalState::Approved {
        "approved"
    } else {
        "denied"
    };
    admin.app.claims.announce(&wake_key(&decided.id));
    admin.app.metrics.approval(&decided.route, label);
    tracing::info!(approval = %decided.id, route = %decided.route, run = %decided.run, amount = %decided.amount, by = %by, reason = decided.reason.as_deref(), "{label}");
    Ok(Decided::Final(decided))
}

/// `current` with the decision applied: approved or denied, or — four eyes — only the
/// first approval recorded (then `true`: a second approver must follow).
fn decision_on(
    admin: &Admin,
    who: &Principal,
    by: &str,
    current: &Approval,
    reason: Option<String>,
    to: ApprovalState,
    now: u64,
) -> Result<(Approval, bool), Problem> {
    let id = &current.id;
    let mut decided = current.clone();
    if to == ApprovalState::Approved && admin.access.needs_two(&current.amount) {
        if who.shared {
            return Err(Problem::new(
                StatusCode::FORBIDDEN,
                "four-eyes-needs-names",
                format!("Approval {id} ({}) needs two different approvers, and the shared admin token cannot tell people apart: approve with a named token ([[admin.tokens]]).", current.amount),
            ));
        }
        // Four eyes counts who authenticated (a token, or a console session of that token),
        // never the `by` a request wrote: one token is one approver whatever it says.
        match &current.first_approval {
            Some(first) if first.who() == who.name => {
                return Err(Problem::new(
                    StatusCode::CONFLICT,
                    "four-eyes",
                    format!("Approval {id} ({}) needs a second approver other than {}, who approved first (recorded as \"{}\"): the same token, through the API or the console, whatever `by` says, is the same approver. Nothing was changed.", current.amount, who.name, first.by),
                ))
            }
            Some(_) => {}
            None => {
                decided.first_approval = Some(FirstApproval {
                    by: by.to_string(),
                    principal: Some(who.name.clone()),
                    at_ms: now,
                    reason,
                });
                return Ok((decided, true));
            }
        }
    }
    decided.state = to;
    decided.decided_by = Some(by.to_string());
    decided.decided_principal = Some(who.name.clone());
    decided.reason = reason;
    decided.decided_ms = Some(now);
    Ok((decided, false))
}

pub(super) fn state_name(a: &Approval, now: u64) -> &'static str {
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
    // Redacted again as shown: approvals an earlier release stored went through an older list.
    let shown = crate::redact::body(&a.body);
    let body = match std::str::from_utf8(&shown) {
        Ok(text) => serde_json::json!({"text": text}),
        Err(_) => {
            serde_json::json!({"base64": base64::engine::general_purpose::STANDARD.encode(&shown)})
        }
    };
    // A tool call: its tool, whose call it is, and its canonical arguments (the body).
    let tool = a.tool.as_ref().map(|t| {
        let arguments = serde_json::from_slice::<serde_json::Value>(&shown)
            .unwrap_or_else(|_| serde_json::Value::String(String::from_utf8_lossy(&shown).into()));
        serde_json::json!({"name": t.name, "account": t.account, "arguments": arguments})
    });
    serde_json::json!({
        "id": a.id,
        "state": state_name(a, now),
        "tool": tool,
        "route": a.route,
        "tenant": a.tenant,
        "run": a.run,
        "amount": a.amount,
        "request": crate::redact::text(&format!("{} {}", a.method, a.path)),
        "body": body,
        "why": a.why,
        "created_ms": a.created_ms,
        "expires_ms": a.expires_ms,
        "decided_by": a.decided_by,
        "decided_principal": a.decided_principal,
        "reason": a.reason.as_deref().map(crate::redact::text),
        "decided_ms": a.decided_ms,
        "first_approval": a.first_approval,
    })
}

fn store_error(e: StoreError) -> Problem {
    Problem::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "store-unavailable",
        format!("{e}. Nothing was changed; try again."),
    )
}
