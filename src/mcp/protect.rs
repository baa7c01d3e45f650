//! Which tool calls are claimed — fail closed: every tool, unless the route lists it as
//! read-only, or the route trusts the server's annotations and the server's own `tools/list`
//! (the proxy's probe, with the caller's credentials) says `readOnlyHint: true`. A tool the
//! list does not name, or a probe that failed, means protected.
//!
//! What a server said about its tools is kept per endpoint — scheme, host, port and path: two
//! MCP servers on one host are two servers, and one's annotations never decide for the
//! other's calls — and per tenant and account (accounts may see other tools), for a while,
//! and dropped when the server says its list changed.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde_json::Value;

/// How long a server's tool list is believed.
const FRESH_FOR: Duration = Duration::from_secs(300);
/// At most this many lists are kept; the oldest go first.
const MAX_LISTS: usize = 1024;

/// Whether one call is claimed, and why not.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Protection {
    Protected,
    /// Passed on unclaimed; the reason is logged.
    ReadOnly(&'static str),
}

/// One server's tools, each with whether it is annotated read-only, and when it was read.
type Listed = (Instant, BTreeMap<String, bool>);

/// The read-only annotations servers gave, per (endpoint, tenant, account).
#[derive(Default)]
pub struct Annotations {
    lists: Mutex<HashMap<String, Listed>>,
    /// The last refused probe of each endpoint (its first one is logged), for the console.
    refusals: Mutex<HashMap<String, Refusal>>,
}

/// Most bytes of a server's answer kept with a refusal.
const ANSWER_KEPT: usize = 512;

/// An endpoint whose server refused the proxy's `tools/list`: while it does, every tool there is
/// claimed, so a read-only tool is answered from a receipt. The operator sees these on the
/// console.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    pub endpoint: String,
    /// When it was first and last refused (ms since the epoch), and how many times.
    pub first_ms: u64,
    pub last_ms: u64,
    pub count: u64,
    /// What the server answered the last time, redacted and cut at `ANSWER_KEPT` bytes.
    pub answer: String,
}

/// The key one list is kept under. The endpoint comes first, so `forget(endpoint)` drops every
/// account's list of that endpoint; each part is length-prefixed, so none can pose as another.
pub fn listed_for(endpoint: &str, tenant: &str, account: &str) -> String {
    format!(
        "{}:{endpoint}|{}:{tenant}|{account}",
        endpoint.len(),
        tenant.len()
    )
}

impl Annotations {
    /// Keeps that the server at `endpoint` refused the probe with `answer` at `now_ms`;
    /// returns whether it is the first refusal since the endpoint last answered (then it is
    /// logged). At most `MAX_LISTS` endpoints are kept: the one refused longest ago goes.
    pub fn refused(&self, endpoint: &str, answer: &str, now_ms: u64) -> bool {
        let Ok(mut refusals) = self.refusals.lock() else {
            return true;
        };
        let mut answer = crate::redact::text(answer);
        if answer.len() > ANSWER_KEPT {
            let mut cut = ANSWER_KEPT;
            while !answer.is_char_boundary(cut) {
                cut -= 1;
            }
            answer.truncate(cut);
            answer.push('…');
        }
        if let Some(r) = refusals.get_mut(endpoint) {
            r.last_ms = now_ms;
            r.count += 1;
            r.answer = answer;
            return false;
        }
        if refusals.len() >= MAX_LISTS {
            if let Some(oldest) = refusals
                .values()
                .min_by_key(|r| r.last_ms)
                .map(|r| r.endpoint.clone())
            {
                refusals.remove(&oldest);
            }
        }
        refusals.insert(
            endpoint.to_string(),
            Refusal {
                endpoint: endpoint.to_string(),
                first_ms: now_ms,
                last_ms: now_ms,
                count: 1,
                answer,
            },
        );
        true
    }

    /// The server at `endpoint` answered the probe: it no longer refuses.
    pub fn answered(&self, endpoint: &str) {
        if let Ok(mut refusals) = self.refusals.lock() {
            refusals.remove(endpoint);
        }
    }

    /// The endpoints refusing the probe now, the most recent first.
    pub fn refusals(&self) -> Vec<Refusal> {
        let mut all: Vec<Refusal> = self
            .refusals
            .lock()
            .map(|r| r.values().cloned().collect())
            .unwrap_or_default();
        all.sort_by_key(|r| std::cmp::Reverse(r.last_ms));
        all
    }

    /// Whether the list for `who` says `tool` is read-only; `None`: no fresh list.
    pub fn read_only(&self, who: &str, tool: &str) -> Option<bool> {
        let lists = self.lists.lock().ok()?;
        let (at, tools) = lists.get(who)?;
        if at.elapsed() > FRESH_FOR {
            return None;
        }
        Some(tools.get(tool).copied().unwrap_or(false))
    }

    pub fn has(&self, who: &str) -> bool {
        self.lists
            .lock()
            .ok()
            .and_then(|l| l.get(who).map(|(at, _)| at.elapsed() <= FRESH_FOR))
            .unwrap_or(false)
    }

    /// Keeps what a whole (every page) `tools/list` said.
    pub fn remember(&self, who: &str, tools: BTreeMap<String, bool>) {
        if let Ok(mut lists) = self.lists.lock() {
            if lists.len() >= MAX_LISTS {
                if let Some(oldest) = lists
                    .iter()
                    .min_by_key(|(_, (at, _))| *at)
                    .map(|(k, _)| k.clone())
                {
                    lists.remove(&oldest);
                }
            }
            lists.insert(who.to_string(), (Instant::now(), tools));
        }
    }

    /// The server said its tools changed (`notifications/tools/list_changed`): every list of
    /// this server (`prefix`) is forgotten.
    pub fn forget(&self, prefix: &str) {
        if let Ok(mut lists) = self.lists.lock() {
            lists.retain(|k, _| !k.starts_with(prefix));
        }
    }
}

/// The tools of one `tools/list` page, each with whether it says `readOnlyHint: true`, and the
/// next page's cursor.
pub fn read_page(result: &Value) -> (BTreeMap<String, bool>, Option<String>) {
    let mut tools = BTreeMap::new();
    for tool in result
        .get("tools")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        if let Some(name) = tool.get("name").and_then(Value::as_str) {
            let read_only = tool
                .pointer("/annotations/readOnlyHint")
                .and_then(Value::as_bool)
                .unwrap_or(false);
            tools.insert(name.to_string(), read_only);
        }
    }
    let next = result
        .get("nextCursor")
        .and_then(Value::as_str)
        .filter(|c| !c.is_empty())
        .map(String::from);
    (tools, next)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_page_names_its_read_only_tools_and_the_next_cursor() {
        let (tools, next) = read_page(&serde_json::json!({
            "tools": [
                {"name": "get_balance", "annotations": {"readOnlyHint": true}},
                {"name": "refund", "annotations": {"readOnlyHint": false}},
                {"name": "bare"}
            ],
            "nextCursor": "p2"
        }));
        assert_eq!(tools.get("get_balance"), Some(&true));
        assert_eq!(tools.get("refund"), Some(&false));
        assert_eq!(tools.get("bare"), Some(&false));
        assert_eq!(next.as_deref(), Some("p2"));
    }

    #[test]
    fn unknown_tools_and_forgotten_lists_are_not_read_only() {
        let a = Annotations::default();
        a.remember("srv|acct", BTreeMap::from([("get".to_string(), true)]));
        assert_eq!(a.read_only("srv|acct", "get"), Some(true));
        assert_eq!(a.read_only("srv|acct", "other"), Some(false));
        assert_eq!(a.read_only("srv|else", "get"), None);
        a.forget("srv|");
        assert_eq!(a.read_only("srv|acct", "get"), None);
    }

    #[test]
    fn each_endpoint_has_its_own_list_and_its_refusal_is_logged_once() {
        let a = Annotations::default();
        let first = listed_for("https://h:443/mcp", "t", "acct");
        let second = listed_for("https://h:443/other", "t", "acct");
        a.remember(&second, BTreeMap::from([("refund".to_string(), true)]));
        assert_eq!(a.read_only(&second, "refund"), Some(true));
        assert_eq!(a.read_only(&first, "refund"), None);
        assert_ne!(
            listed_for("https://h/a|1:b", "c", "d"),
            listed_for("https://h/a", "b|1:c", "d")
        );
        assert!(a.refused("https://h:443/mcp", "the server answered 400", 1_000));
        assert!(!a.refused(
            "https://h:443/mcp",
            "the server answered 401: Bearer sk_live_abcdefghijklmnop",
            2_000
        ));
        assert!(a.refused("https://h:443/other", "timed out", 1_500));
        let seen = a.refusals();
        assert_eq!(seen.len(), 2);
        let mcp = &seen[0];
        assert_eq!(
            (mcp.endpoint.as_str(), mcp.first_ms, mcp.last_ms, mcp.count),
            ("https://h:443/mcp", 1_000, 2_000, 2)
        );
        assert!(mcp.answer.starts_with("the server answered 401"), "{mcp:?}");
        assert!(!mcp.answer.contains("sk_live_abcdefghijklmnop"), "{mcp:?}");
        // Answered once more: no longer refusing, and a later refusal is a first again.
        a.answered("https://h:443/mcp");
        assert_eq!(a.refusals().len(), 1);
        assert!(a.refused("https://h:443/mcp", "400", 3_000));
    }
}
