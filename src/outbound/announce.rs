//! Announces each new approval request to the `[approvals] webhook`: a JSON POST (with a
//! `text` line, so a chat's incoming webhook shows it as a message), from a task of its own,
//! retried with back-off. The request path only queues the notice: a slow or dead webhook
//! never delays a payment, and a full queue drops the notice (the approval itself stands;
//! `idemproxy approvals list` shows it).

use std::sync::Arc;
use std::time::Duration;

use http::{header, HeaderValue, Method, Request, Uri};
use tokio::sync::mpsc;

use super::upstream::UpstreamClient;
use crate::http::body::full;
use crate::metrics::Metrics;
use crate::spend::gate::Announcer;
use crate::spend::port::Approval;

const QUEUE: usize = 1024;
const ATTEMPTS: u32 = 6;
const FIRST_BACKOFF: Duration = Duration::from_millis(500);
const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(5);

pub struct Webhook {
    /// Notices, rendered: new approvals, and the admin audit trail's events.
    queue: mpsc::Sender<(String, String)>,
    metrics: Arc<Metrics>,
}

impl Webhook {
    /// Starts the sender task; it ends when the proxy drops the webhook.
    pub fn start(url: Uri, client: UpstreamClient, metrics: Arc<Metrics>) -> Webhook {
        let (queue, mut rx) = mpsc::channel::<(String, String)>(QUEUE);
        let m = metrics.clone();
        tokio::spawn(async move {
            while let Some((about, body)) = rx.recv().await {
                let sent = deliver(&client, &url, &body).await;
                m.approval_notice(if sent { "sent" } else { "failed" });
                if !sent {
                    tracing::warn!(about = %about, "the approvals webhook did not take a notice after {ATTEMPTS} attempts");
                }
            }
        });
        Webhook { queue, metrics }
    }

    /// Queues a JSON notice (`about` names it in logs); a full queue drops it.
    pub fn send(&self, about: &str, body: String) {
        if self.queue.try_send((about.to_string(), body)).is_err() {
            self.metrics.approval_notice("dropped");
            tracing::warn!(about = %about, "the approvals webhook queue is full: notice dropped");
        }
    }
}

impl Announcer for Webhook {
    fn announce(&self, approval: &Approval) {
        self.send(&approval.id, notice(approval));
    }
}

/// Tries until the webhook answers 2xx, backing off between attempts.
async fn deliver(client: &UpstreamClient, url: &Uri, body: &str) -> bool {
    let mut backoff = FIRST_BACKOFF;
    for attempt in 1..=ATTEMPTS {
        let mut req = Request::new(full(body.to_string()));
        *req.method_mut() = Method::POST;
        *req.uri_mut() = url.clone();
        req.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        match tokio::time::timeout(ATTEMPT_TIMEOUT, client.send(req)).await {
            Ok(Ok(resp)) if resp.status().is_success() => return true,
            Ok(Ok(resp)) => {
                tracing::debug!(attempt, status = %resp.status(), "approvals webhook refused the notice")
            }
            Ok(Err(e)) => tracing::debug!(attempt, error = %e, "approvals webhook unreachable"),
            Err(_) => tracing::debug!(attempt, "approvals webhook did not answer in time"),
        }
        if attempt < ATTEMPTS {
            tokio::time::sleep(backoff).await;
            backoff *= 2;
        }
    }
    false
}

/// The notice: what is asked and how to decide. No request body (it may hold personal
/// data; approvers read it through the admin API) and no credential.
fn notice(a: &Approval) -> String {
    serde_json::json!({
        "text": format!(
            "Approval needed: {} on {} ({} {}) for run {} of tenant {}: {}. Decide with `idemproxy approvals approve {} --by NAME` or `idemproxy approvals deny {} --by NAME --reason WHY`.",
            a.amount, a.route, a.method, a.path, a.run, a.tenant, a.why, a.id, a.id
        ),
        "approval": {
            "id": a.id,
            "route": a.route,
            "tenant": a.tenant,
            "run": a.run,
            "amount": a.amount,
            "request": format!("{} {}", a.method, a.path),
            // A parked MCP tool call: its tool (its arguments, like a body, are not sent).
            "tool": a.tool.as_ref().map(|t| &t.name),
            "why": a.why,
            "created_ms": a.created_ms,
            "expires_ms": a.expires_ms,
        },
    })
    .to_string()
}
