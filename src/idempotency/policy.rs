//! A route's idempotency policy, resolved from config and provider profile.

use std::time::Duration;

use super::outcome::BodyRule;
use crate::config::{Hold, OnInFlight};

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
