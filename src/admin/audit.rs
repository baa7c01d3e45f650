//! The audit trail: every decision a person makes through the admin listener (approve,
//! deny, release, attested commit, freeze and unfreeze) as one JSON line in the log (target
//! `idemproxy::audit`) and as a notice to the `[approvals] webhook`. Records live for the
//! retention period; this trail is what finance keeps for months.

use std::sync::Arc;

use serde::Serialize;
use sha2::{Digest, Sha256};

use super::access::Principal;
use crate::idempotency::record::ResolvedBy;
use crate::outbound::announce::Webhook;
use crate::spend::port::{Approval, FreezeTarget, OperatorSession};

/// One decision.
#[derive(Debug, Clone, Serialize)]
pub struct AuditEvent {
    /// `approval.approved`, `approval.first_approval`, `approval.denied`, `claim.released`,
    /// `claim.attested`, `spend.frozen`, `spend.unfrozen`.
    pub event: &'static str,
    /// Who decided as people read it: the principal, with what its request said (`ana (as
    /// ana@example.com)`), or what the shared token's request said.
    pub by: String,
    /// Who decided as the admin listener authenticated them: the token's name (a console
    /// session is its token's). Four eyes compares these.
    pub principal: String,
    pub role: &'static str,
    /// Through the console or the JSON API.
    pub via: &'static str,
    pub at_ms: u64,
    pub why: Option<String>,
    /// The approval id or the claim's scope.
    pub subject: String,
    pub route: String,
    pub tenant: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub run: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub amount: Option<String>,
    /// What the decision was bound to: for an approval, SHA-256 over method, path, amount
    /// and body as the approver saw them; for a claim, its request fingerprint.
    pub bound_fingerprint: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
}

/// Where audit events go.
#[derive(Clone, Default)]
pub struct Audit {
    webhook: Option<Arc<Webhook>>,
}

impl Audit {
    pub fn new(webhook: Option<Arc<Webhook>>) -> Audit {
        Audit { webhook }
    }

    pub fn record(&self, e: &AuditEvent) {
        // What a person typed (a reason, a pasted response) is kept for months and read by
        // finance: a card number or a key typed into it is redacted like anywhere else.
        let redacted = AuditEvent {
            why: e.why.as_deref().map(crate::redact::text),
            detail: e.detail.as_deref().map(crate::redact::text),
            ..e.clone()
        };
        let e = &redacted;
        let line = serde_json::to_string(e).unwrap_or_default();
        tracing::info!(target: "idemproxy::audit", audit = %line, "{}", e.event);
        if let Some(hook) = &self.webhook {
            let who = if e.by == e.principal {
                e.by.clone()
            } else {
                format!("{} (token {})", e.by, e.principal)
            };
            let text = format!(
                "{} by {} ({}) on {} {}{}",
                e.event,
                who,
                e.role,
                e.route,
                e.subject,
                e.why
                    .as_deref()
                    .map(|w| format!(": {w}"))
                    .unwrap_or_default()
            );
            let body = serde_json::json!({"text": text, "audit": e}).to_string();
            hook.send(e.event, body);
        }
    }
}

impl std::fmt::Debug for Audit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Audit")
            .field("webhook", &self.webhook.is_some())
            .finish()
    }
}

/// The fingerprint of what an approver saw: method, path, amount and body.
pub fn approval_fingerprint(a: &Approval) -> String {
    let mut h = Sha256::new();
    for part in [
        a.method.as_bytes(),
        a.path.as_bytes(),
        a.amount.as_bytes(),
        &a.body,
    ] {
        h.update((part.len() as u64).to_be_bytes());
        h.update(part);
    }
    hex::encode(h.finalize())
}

/// An event about an approval, decided by `who` (recorded as `by`).
pub fn about_approval(
    event: &'static str,
    who: &Principal,
    by: &str,
    via: &'static str,
    at_ms: u64,
    why: Option<String>,
    a: &Approval,
) -> AuditEvent {
    AuditEvent {
        event,
        by: by.to_string(),
        principal: who.name.clone(),
        role: who.role.as_str(),
        via,
        at_ms,
        why,
        subject: a.id.clone(),
        route: a.route.clone(),
        tenant: a.tenant.clone(),
        run: Some(a.run.clone()),
        amount: Some(a.amount.clone()),
        bound_fingerprint: approval_fingerprint(a),
        detail: None,
    }
}

/// An event about a held claim resolved by `who` (`how`: released or attested).
pub fn about_claim(
    who: &Principal,
    via: &'static str,
    scope: &str,
    route: &str,
    fingerprint: String,
    r: &ResolvedBy,
) -> AuditEvent {
    AuditEvent {
        event: if r.how == "released" {
            "claim.released"
        } else {
            "claim.attested"
        },
        by: r.by.clone(),
        principal: who.name.clone(),
        role: who.role.as_str(),
        via,
        at_ms: r.at_ms,
        why: r.why.clone(),
        subject: scope.to_string(),
        route: route.to_string(),
        tenant: scope.split(':').nth(1).unwrap_or("").to_string(),
        run: None,
        amount: None,
        bound_fingerprint: fingerprint,
        detail: r.object.as_ref().map(|o| format!("provider object {o}")),
    }
}

/// A freeze or its lifting (`event`: `spend.frozen`, `spend.unfrozen`) by `who`. The subject
/// is the target as the store names it (`tenant:acme`, `run:acme/r1`, `route:stripe`).
pub fn about_freeze(
    event: &'static str,
    who: &Principal,
    by: &str,
    via: &'static str,
    at_ms: u64,
    why: &str,
    target: &FreezeTarget,
) -> AuditEvent {
    let (route, tenant, run) = match target {
        FreezeTarget::Tenant(t) => ("*".to_string(), t.clone(), None),
        FreezeTarget::Run { tenant, run } => ("*".to_string(), tenant.clone(), Some(run.clone())),
        FreezeTarget::Route(r) => (r.clone(), "*".to_string(), None),
    };
    AuditEvent {
        event,
        by: by.to_string(),
        principal: who.name.clone(),
        role: who.role.as_str(),
        via,
        at_ms,
        why: (!why.is_empty()).then(|| why.to_string()),
        subject: target.key(),
        route,
        tenant,
        run,
        amount: None,
        bound_fingerprint: String::new(),
        detail: Some(FreezeTarget::describe(&target.key())),
    }
}

/// An operator (`who`) ending another console session (`session.ended`): the subject is the
/// session's id, the principal whose session it was is in `detail`.
pub fn about_session(
    who: &Principal,
    via: &'static str,
    at_ms: u64,
    ended: &OperatorSession,
) -> AuditEvent {
    AuditEvent {
        event: "session.ended",
        by: who.name.clone(),
        principal: who.name.clone(),
        role: who.role.as_str(),
        via,
        at_ms,
        why: None,
        subject: ended.id.clone(),
        route: "*".into(),
        tenant: "*".into(),
        run: None,
        amount: None,
        bound_fingerprint: String::new(),
        detail: Some(format!(
            "the console session of {} ({})",
            ended.name, ended.role
        )),
    }
}
