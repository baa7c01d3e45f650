//! What the pages show, as plain strings: the templates escape every one of them.

use crate::admin::audit::approval_fingerprint;
use crate::admin::session::Session;
use crate::idempotency::record::{Record, State};
use crate::spend::port::Approval;

pub struct UserView {
    pub name: String,
    pub role: &'static str,
    pub csrf: String,
}

impl UserView {
    pub fn of(s: &Session) -> UserView {
        UserView {
            name: s.who.name.clone(),
            role: s.who.role.as_str(),
            csrf: s.csrf.clone(),
        }
    }
}

pub struct Flash {
    /// `ok` or `error` (a CSS class).
    pub kind: &'static str,
    pub text: String,
}

pub struct VariantView {
    pub amount: String,
    pub method: String,
    pub path: String,
    pub body_sha256: String,
    pub seen: String,
}

pub struct ApprovalView {
    pub id: String,
    pub amount: String,
    pub route: String,
    pub run: String,
    pub tenant: String,
    pub age: String,
    pub expires_in: String,
    pub why: String,
    pub method: String,
    pub path: String,
    pub fingerprint: String,
    pub body: String,
    pub masked: bool,
    pub conflict: bool,
    pub variants: Vec<VariantView>,
    pub first_approval: Option<String>,
    /// A parked MCP tool call: the tool, and the account's fingerprint.
    pub tool: Option<String>,
    pub account: Option<String>,
}

impl ApprovalView {
    pub fn of(a: &Approval, now: u64) -> ApprovalView {
        let (body, masked) = crate::redact::for_person(&a.body);
        ApprovalView {
            id: a.id.clone(),
            amount: if a.amount.is_empty() {
                "unpriced".into()
            } else {
                a.amount.clone()
            },
            route: a.route.clone(),
            run: a.run.clone(),
            tenant: a.tenant.clone(),
            age: ago(now, a.created_ms),
            expires_in: until(now, a.expires_ms),
            why: a.why.clone(),
            method: a.method.clone(),
            path: crate::redact::text(&a.path),
            fingerprint: approval_fingerprint(a),
            body,
            masked,
            conflict: !a.variants.is_empty(),
            variants: a
                .variants
                .iter()
                .map(|v| VariantView {
                    amount: v.amount.clone(),
                    method: v.method.clone(),
                    path: v.path.clone(),
                    body_sha256: v.body_sha256.clone(),
                    seen: ago(now, v.seen_ms),
                })
                .collect(),
            first_approval: a.first_approval.as_ref().map(|f| {
                format!(
                    "{} {}{}",
                    f.by,
                    ago(now, f.at_ms),
                    f.reason
                        .as_deref()
                        .map(|r| format!(" ({})", crate::redact::text(r)))
                        .unwrap_or_default()
                )
            }),
            tool: a.tool.as_ref().map(|t| t.name.clone()),
            account: a.tool.as_ref().map(|t| t.account.clone()),
        }
    }
}

pub struct HeldView {
    pub scope: String,
    pub token: String,
    pub route: String,
    pub tenant: String,
    pub age: String,
    pub since: String,
    pub note: String,
}

impl HeldView {
    pub fn of(scope: &str, r: &Record, now: u64) -> HeldView {
        let since = if r.body.unknown_since_ms > 0 {
            r.body.unknown_since_ms
        } else {
            r.body.created_ms
        };
        HeldView {
            scope: scope.to_string(),
            token: r.token.as_str().to_string(),
            route: r.body.route.clone(),
            tenant: tenant_of(scope),
            age: ago(now, since),
            since: clock(since),
            note: r
                .body
                .note
                .clone()
                .unwrap_or_else(|| "the outcome was not seen (no note)".into()),
        }
    }
}

pub struct ReceiptView {
    pub status: u16,
    pub bytes: usize,
    pub header_names: String,
    pub attested: Option<String>,
    pub body: String,
}

pub struct HistoryItem {
    pub at: String,
    pub at_ms: u64,
    pub what: String,
    pub by: Option<String>,
    pub why: Option<String>,
}

pub struct RecordView {
    pub scope: String,
    pub state: &'static str,
    pub route: String,
    pub tenant: String,
    pub fingerprint: String,
    pub token: String,
    pub note: Option<String>,
    pub receipt: Option<ReceiptView>,
    pub replays: String,
    pub history: Vec<HistoryItem>,
}

impl RecordView {
    /// The record, and the approval of its operation if one was asked for.
    pub fn of(scope: &str, r: &Record, approval: Option<&Approval>) -> RecordView {
        let history = history(r, approval);
        let receipt = r.body.receipt.as_ref().map(|rc| {
            let (body, _) = crate::redact::for_person(&rc.body);
            ReceiptView {
                status: rc.status,
                bytes: rc.body.len(),
                header_names: rc
                    .headers
                    .iter()
                    .map(|(k, _)| k.as_str())
                    .collect::<Vec<_>>()
                    .join(", "),
                attested: rc
                    .headers
                    .iter()
                    .find(|(k, _)| k == crate::admin::keys::ATTESTED_HEADER)
                    .map(|(_, v)| v.clone()),
                body,
            }
        });
        RecordView {
            scope: scope.to_string(),
            state: r.state.as_str(),
            route: r.body.route.clone(),
            tenant: tenant_of(scope),
            fingerprint: r.body.fingerprint.clone(),
            token: r.token.as_str().to_string(),
            note: r.body.note.clone(),
            receipt,
            replays: "not counted per key: idemproxy_requests_total{outcome=\"replayed\"} counts them per route".into(),
            history,
        }
    }
}

/// What happened to the operation, oldest first: from the record and its approval.
fn history(r: &Record, approval: Option<&Approval>) -> Vec<HistoryItem> {
    let mut history = vec![item(r.body.created_ms, "claimed", None, None)];
    if let Some(a) = approval {
        history.push(item(
            a.created_ms,
            &format!("approval asked: {}", a.why),
            None,
            None,
        ));
        if let Some(f) = &a.first_approval {
            history.push(item(
                f.at_ms,
                "first approval",
                Some(f.by.clone()),
                f.reason.clone(),
            ));
        }
        if let (Some(at), Some(by)) = (a.decided_ms, &a.decided_by) {
            history.push(item(
                at,
                &format!("{:?}", a.state).to_lowercase(),
                Some(by.clone()),
                a.reason.clone(),
            ));
        }
    }
    if r.state == State::Unknown {
        history.push(item(
            r.body.unknown_since_ms,
            "outcome unknown: held",
            None,
            r.body.note.clone(),
        ));
    }
    if r.body.settled_ms > 0 && r.body.resolved.is_none() {
        history.push(item(
            r.body.settled_ms,
            "settled (the provider's answer is the receipt)",
            None,
            None,
        ));
    }
    if let Some(res) = &r.body.resolved {
        let what = match res.object.as_deref() {
            Some(o) => format!("resolved: {} (provider object {o})", res.how),
            None => format!("resolved: {}", res.how),
        };
        history.push(item(
            res.at_ms,
            &what,
            Some(res.by.clone()),
            res.why.clone(),
        ));
    }
    history.sort_by_key(|h| h.at_ms);
    history
}

fn item(at_ms: u64, what: &str, by: Option<String>, why: Option<String>) -> HistoryItem {
    HistoryItem {
        at: clock(at_ms),
        at_ms,
        what: what.to_string(),
        by,
        // What a person typed (a reason) may hold what nobody else may read.
        why: why.as_deref().map(crate::redact::text),
    }
}

pub fn tenant_of(scope: &str) -> String {
    scope.split(':').nth(1).unwrap_or("").to_string()
}

/// `2026-12-01 15:27:44 UTC`.
pub fn clock(ms: u64) -> String {
    match time::OffsetDateTime::from_unix_timestamp((ms / 1000) as i64) {
        Ok(t) => format!(
            "{:04}-{:02}-{:02} {:02}:{:02}:{:02} UTC",
            t.year(),
            u8::from(t.month()),
            t.day(),
            t.hour(),
            t.minute(),
            t.second()
        ),
        Err(_) => format!("{ms} ms"),
    }
}

/// `3 min ago`.
pub fn ago(now: u64, then: u64) -> String {
    format!("{} ago", span(now.saturating_sub(then)))
}

/// `in 3 min`, or `expired`.
pub fn until(now: u64, then: u64) -> String {
    if then <= now {
        "expired".into()
    } else {
        format!("in {}", span(then - now))
    }
}

pub fn span(ms: u64) -> String {
    let s = ms / 1000;
    match s {
        0..=59 => format!("{s} s"),
        60..=3599 => format!("{} min", s / 60),
        3600..=86399 => format!("{} h {} min", s / 3600, (s % 3600) / 60),
        _ => format!("{} d {} h", s / 86400, (s % 86400) / 3600),
    }
}
