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

/// How long a server's tool list is believed at most; a list whose `ttlMs` (2026-07-28) is
/// shorter is believed that long.
pub const FRESH_FOR: Duration = Duration::from_secs(300);
/// At most this many lists are kept; the oldest go first.
const MAX_LISTS: usize = 1024;

/// Whether one call is claimed, and why not.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Protection {
    Protected,
    /// Passed on unclaimed; the reason is logged.
    ReadOnly(&'static str),
}

/// One server's tools, each with whether it is annotated read-only, when it was read and how
/// long it is believed.
type Listed = (Instant, Duration, BTreeMap<String, bool>);

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
        let (at, fresh_for, tools) = lists.get(who)?;
        if at.elapsed() >= *fresh_for {
            return None;
        }
        Some(tools.get(tool).copied().unwrap_or(false))
    }

    /// Keeps what a whole (every page) `tools/list` said, for `fresh_for` (at most
    /// `FRESH_FOR`; zero keeps nothing: the server said its list is stale at once).
    pub fn remember(&self, who: &str, tools: BTreeMap<String, bool>, fresh_for: Duration) {
        let fresh_for = fresh_for.min(FRESH_FOR);
        if fresh_for.is_zero() {
            return;
        }
        if let Ok(mut lists) = self.lists.lock() {
            if lists.len() >= MAX_LISTS {
                if let Some(oldest) = lists
                    .iter()
                    .min_by_key(|(_, (at, _, _))| *at)
                    .map(|(k, _)| k.clone())
                {
                    lists.remove(&oldest);
                }
            }
            lists.insert(who.to_string(), (Instant::now(), fresh_for, tools));
        }
    }

    /// The server at `endpoint` said its tools changed (`notifications/tools/list_changed`):
    /// every tenant's and account's list of that endpoint is forgotten.
    pub fn forget(&self, endpoint: &str) {
        let prefix = format!("{}:{endpoint}|", endpoint.len());
        if let Ok(mut lists) = self.lists.lock() {
            lists.retain(|k, _| !k.starts_with(&prefix));
        }
    }
}

/// How long a `tools/list` page says it may be kept: its `ttlMs` (2026-07-28); `None` when it
/// says nothing (2025 revisions), then `FRESH_FOR`. `cacheScope` needs no reading: lists are
/// kept per account whatever it says, which `private` requires and `public` allows.
pub fn page_ttl(result: &Value) -> Option<Duration> {
    result
        .get("ttlMs")
        .and_then(Value::as_u64)
        .map(Duration::from_millis)
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
        let get = || BTreeMap::from([("get".to_string(), true)]);
        let (mine, theirs) = (
            listed_for("https://h:443/mcp", "t", "acct"),
            listed_for("https://h:443/mcp", "t", "else"),
        );
        let other = listed_for("https://h:443/mcp2", "t", "acct");
        a.remember(&mine, get(), FRESH_FOR);
        a.remember(&theirs, get(), FRESH_FOR);
        a.remember(&other, get(), FRESH_FOR);
        assert_eq!(a.read_only(&mine, "get"), Some(true));
        assert_eq!(a.read_only(&mine, "other"), Some(false));
        assert_eq!(
            a.read_only(&listed_for("https://h:443/mcp", "t", "x"), "get"),
            None
        );
        // list_changed from /mcp: every account's list of /mcp goes, /mcp2's stays.
        a.forget("https://h:443/mcp");
        assert_eq!(a.read_only(&mine, "get"), None);
        assert_eq!(a.read_only(&theirs, "get"), None);
        assert_eq!(a.read_only(&other, "get"), Some(true));
    }

    #[test]
    fn a_lists_ttl_bounds_how_long_it_is_believed() {
        let a = Annotations::default();
        let who = listed_for("https://h:443/mcp", "t", "acct");
        let get = || BTreeMap::from([("get".to_string(), true)]);
        // ttlMs 0: stale at once, nothing kept.
        a.remember(&who, get(), Duration::ZERO);
        assert_eq!(a.read_only(&who, "get"), None);
        a.remember(&who, get(), Duration::from_millis(30));
        assert_eq!(a.read_only(&who, "get"), Some(true));
        std::thread::sleep(Duration::from_millis(40));
        assert_eq!(a.read_only(&who, "get"), None);
        assert_eq!(
            page_ttl(&serde_json::json!({"tools": [], "ttlMs": 1500, "cacheScope": "private"})),
            Some(Duration::from_millis(1500))
        );
        assert_eq!(page_ttl(&serde_json::json!({"tools": []})), None);
    }

    #[test]
    fn each_endpoint_has_its_own_list_and_its_refusal_is_logged_once() {
        let a = Annotations::default();
        let first = listed_for("https://h:443/mcp", "t", "acct");
        let second = listed_for("https://h:443/other", "t", "acct");
        a.remember(
            &second,
            BTreeMap::from([("refund".to_string(), true)]),
            FRESH_FOR,
        );
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
