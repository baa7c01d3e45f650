//! A route's idempotency policy, resolved from config and provider profile.

use std::fmt;
use std::time::Duration;

use serde::{Deserialize, Deserializer};

/// Which statuses become a receipt: `2xx`-style classes or single codes, minus exclusions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StatusSet {
    include: Vec<(u16, u16)>,
    exclude: Vec<(u16, u16)>,
}

impl StatusSet {
    /// Parses entries like `2xx`, `404`, `!409`, `!5xx`.
    pub fn parse(entries: &[String]) -> Result<StatusSet, String> {
        let mut set = StatusSet {
            include: Vec::new(),
            exclude: Vec::new(),
        };
        for e in entries {
            let (negate, body) = match e.trim().strip_prefix('!') {
                Some(rest) => (true, rest.trim()),
                None => (false, e.trim()),
            };
            let range = if let Some(class) =
                body.strip_suffix("xx").or_else(|| body.strip_suffix("XX"))
            {
                match class.parse::<u16>() {
                    Ok(c) if (1..=5).contains(&c) => (c * 100, c * 100 + 99),
                    _ => return Err(format!("`{e}` is not a status class like 2xx")),
                }
            } else {
                match body.parse::<u16>() {
                    Ok(c) if (100..=599).contains(&c) => (c, c),
                    _ => return Err(format!("`{e}` is not a status code (100-599), a class like 2xx, or an exclusion like !409")),
                }
            };
            if negate {
                set.exclude.push(range);
            } else {
                set.include.push(range);
            }
        }
        Ok(set)
    }

    pub fn contains(&self, status: u16) -> bool {
        let within = |(lo, hi): &(u16, u16)| (*lo..=*hi).contains(&status);
        self.include.iter().any(within) && !self.exclude.iter().any(within)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum OnInFlight {
    /// 409 with Retry-After.
    #[default]
    Conflict,
    /// Wait for the first request to settle, then replay its receipt.
    Wait,
}

/// How long an UNKNOWN outcome is held.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hold {
    For(Duration),
    Forever,
}

impl<'de> Deserialize<'de> for Hold {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        if s.trim().eq_ignore_ascii_case("forever") {
            return Ok(Hold::Forever);
        }
        humantime::parse_duration(s.trim())
            .map(Hold::For)
            .map_err(|e| {
                serde::de::Error::custom(format!(
                    "`{s}` is neither `forever` nor a duration like 5m: {e}"
                ))
            })
    }
}

impl fmt::Display for Hold {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Hold::For(d) => write!(f, "{}", humantime::format_duration(*d)),
            Hold::Forever => f.write_str("forever"),
        }
    }
}

/// An outcome read from a response body.
#[derive(Debug, Clone)]
pub struct BodyRule {
    /// `None`: every status.
    pub statuses: Option<StatusSet>,
    /// All must hold.
    pub conditions: Vec<Condition>,
    pub outcome: RuleOutcome,
    pub note: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RuleOutcome {
    Commit,
    Decline,
    Release,
    Unknown,
    Duplicate,
    /// The answer asks the client for input before anything happens (MCP's
    /// `input_required`): the claim waits this long for the call's continuation. Set by
    /// protocols, never written in a config.
    Await(Duration),
}

impl RuleOutcome {
    pub fn parse(s: &str) -> Option<RuleOutcome> {
        Some(match s {
            "commit" => RuleOutcome::Commit,
            "decline" => RuleOutcome::Decline,
            "release" => RuleOutcome::Release,
            "unknown" => RuleOutcome::Unknown,
            "duplicate" => RuleOutcome::Duplicate,
            _ => return None,
        })
    }
}

/// A JSON field (`error`, `data.0.sCode`) tested one way.
#[derive(Debug, Clone)]
pub struct Condition {
    pub field: Vec<String>,
    pub test: Test,
}

#[derive(Debug, Clone)]
pub enum Test {
    /// Its value, as text (numbers as written), is one of these.
    Equals(Vec<String>),
    /// It is present, and its value is none of these.
    NotEquals(Vec<String>),
    /// It (or any item of it, for an array) is text starting with one of these.
    Prefix(Vec<String>),
    /// A non-empty array, object or string.
    NonEmpty,
    /// Some `text` member in it, at any depth (an MCP result's content items), is a string
    /// containing one of these, ASCII case-insensitive (given lowercase).
    TextContains(Vec<String>),
}

impl Condition {
    pub fn new(field: &str, test: Test) -> Condition {
        Condition {
            field: field.split('.').map(String::from).collect(),
            test,
        }
    }

    pub fn holds(&self, body: &serde_json::Value) -> bool {
        let mut cur = body;
        for seg in &self.field {
            let next = match cur {
                serde_json::Value::Object(m) => m.get(seg),
                serde_json::Value::Array(a) => seg.parse::<usize>().ok().and_then(|i| a.get(i)),
                _ => None,
            };
            match next {
                Some(v) => cur = v,
                None => return false,
            }
        }
        let text = |v: &serde_json::Value| match v {
            serde_json::Value::String(s) => Some(s.clone()),
            serde_json::Value::Number(n) => Some(n.to_string()),
            serde_json::Value::Bool(b) => Some(b.to_string()),
            _ => None,
        };
        match &self.test {
            Test::Equals(values) => text(cur).is_some_and(|t| values.contains(&t)),
            Test::NotEquals(values) => text(cur).is_some_and(|t| !values.contains(&t)),
            Test::Prefix(prefixes) => {
                let starts = |v: &serde_json::Value| {
                    text(v).is_some_and(|t| prefixes.iter().any(|p| t.starts_with(p.as_str())))
                };
                match cur {
                    serde_json::Value::Array(items) => items.iter().any(starts),
                    v => starts(v),
                }
            }
            Test::TextContains(needles) => any_text(cur, &|t| {
                let t = t.to_ascii_lowercase();
                needles.iter().any(|n| t.contains(n.as_str()))
            }),
            Test::NonEmpty => match cur {
                serde_json::Value::Array(a) => !a.is_empty(),
                serde_json::Value::Object(m) => !m.is_empty(),
                serde_json::Value::String(s) => !s.is_empty(),
                _ => false,
            },
        }
    }
}

/// Whether some `text` member in `v`, at any depth, is a string that passes `test`.
fn any_text(v: &serde_json::Value, test: &dyn Fn(&str) -> bool) -> bool {
    match v {
        serde_json::Value::Array(items) => items.iter().any(|i| any_text(i, test)),
        serde_json::Value::Object(m) => m.iter().any(|(k, i)| match i {
            serde_json::Value::String(s) => k == "text" && test(s),
            other => any_text(other, test),
        }),
        _ => false,
    }
}

impl BodyRule {
    pub fn matches(&self, status: u16, body: &serde_json::Value) -> bool {
        self.applies_to(status) && self.conditions.iter().all(|c| c.holds(body))
    }

    /// Whether the rule reads answers with this status at all.
    pub fn applies_to(&self, status: u16) -> bool {
        self.statuses.as_ref().is_none_or(|s| s.contains(status))
    }
}

#[derive(Debug, Clone)]
pub struct Policy {
    /// The provider deduplicates on the key we pass down, so an uncertain outcome can be retried.
    pub honours_key: bool,
    pub commit_statuses: StatusSet,
    /// Committed statuses that say nothing happened (see `Outcome::Declined`).
    pub declined_statuses: StatusSet,
    /// On a provider that does not honour keys, these statuses leave the outcome UNKNOWN.
    pub unknown_statuses: Vec<u16>,
    /// Outcomes read from the response body, checked before the statuses.
    pub rules: std::sync::Arc<[BodyRule]>,
    pub hold: Hold,
    pub lease: Duration,
    pub retention: Duration,
    /// The route's total upstream deadline: how long a holder's call may still be running.
    pub upstream_timeout: Duration,
    pub on_in_flight: OnInFlight,
    pub fail_open: bool,
    /// The route can ask the provider whether a held operation happened: how old an unknown
    /// outcome must be before a "not found" counts (an operation may still be arriving).
    /// `None`: no lookup; held outcomes wait for their hold or an operator.
    pub reconcile_after: Option<Duration>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_commit_set() {
        let s = StatusSet::parse(
            &["2xx", "3xx", "4xx", "!408", "!409", "!425", "!429"].map(String::from),
        )
        .expect("parses");
        for ok in [200, 201, 204, 302, 400, 402, 404, 422] {
            assert!(s.contains(ok), "{ok}");
        }
        for no in [100, 408, 409, 425, 429, 500, 502, 503, 504] {
            assert!(!s.contains(no), "{no}");
        }
    }

    #[test]
    fn rejects_nonsense() {
        for bad in ["6xx", "abc", "99", "!", "2x"] {
            assert!(StatusSet::parse(&[bad.to_string()]).is_err(), "{bad}");
        }
    }
}
