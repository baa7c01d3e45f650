//! Requests by route and outcome over the last hour, for the console's overview: the
//! request counters are sampled once a minute and the oldest sample within the hour is
//! subtracted from the counts now. Per process (each replica shows its own traffic); the
//! Prometheus counters are what dashboards sum across replicas.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::idempotency::store::now_ms;
use crate::metrics::Metrics;

/// `(route, outcome)` → requests.
pub type Counts = BTreeMap<(String, String), u64>;

const EVERY: Duration = Duration::from_secs(60);
const HOUR_MS: u64 = 3_600_000;

#[derive(Default)]
pub struct Traffic {
    samples: Mutex<VecDeque<(u64, Counts)>>,
}

impl Traffic {
    fn push(&self, at_ms: u64, counts: Counts) {
        let mut s = self.samples.lock().unwrap_or_else(|e| e.into_inner());
        s.push_back((at_ms, counts));
        // Keep one sample older than an hour, so the hour is always covered once it can be.
        while s.len() > 2
            && s.get(1)
                .is_some_and(|(t, _)| at_ms.saturating_sub(*t) >= HOUR_MS)
        {
            s.pop_front();
        }
    }

    /// Requests since the oldest sample within the last hour (or since the process started),
    /// and since when that is.
    pub fn last_hour(&self, metrics: &Metrics) -> (Counts, u64) {
        let now = request_counts(&metrics.encode());
        let s = self.samples.lock().unwrap_or_else(|e| e.into_inner());
        let at = now_ms();
        let base = s.iter().find(|(t, _)| at.saturating_sub(*t) <= HOUR_MS);
        let (since, base) = match base {
            Some((t, c)) => (*t, c.clone()),
            None => (s.front().map(|(t, _)| *t).unwrap_or(at), Counts::new()),
        };
        let diff = now
            .into_iter()
            .map(|(k, v)| {
                let before = base.get(&k).copied().unwrap_or(0);
                (k, v.saturating_sub(before))
            })
            .filter(|(_, v)| *v > 0)
            .collect();
        (diff, since)
    }
}

/// Samples the request counters now and every minute after.
pub fn start_sampling(traffic: Arc<Traffic>, metrics: Arc<Metrics>) {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(EVERY);
        loop {
            tick.tick().await;
            traffic.push(now_ms(), request_counts(&metrics.encode()));
        }
    });
}

/// `idemproxy_requests_total{route="…",outcome="…"} N` lines of the Prometheus text, and
/// the unprotected requests by reason as outcomes `unprotected:REASON`.
pub fn request_counts(text: &str) -> Counts {
    let requests = family(text, "idemproxy_requests_total{")
        .into_iter()
        .filter_map(|(labels, v)| {
            Some((
                (labels.get("route")?.clone(), labels.get("outcome")?.clone()),
                v as u64,
            ))
        });
    let unprotected = family(text, "idemproxy_unprotected_requests_total{")
        .into_iter()
        .filter_map(|(labels, v)| {
            Some((
                (
                    labels.get("route")?.clone(),
                    format!("{UNPROTECTED}{}", labels.get("reason")?),
                ),
                v as u64,
            ))
        });
    requests.chain(unprotected).collect()
}

/// Outcomes that are a reason an unprotected request had, not a column of their own.
pub const UNPROTECTED: &str = "unprotected:";

/// Every sample of one metric family: its labels and value.
pub fn family(text: &str, prefix: &str) -> Vec<(BTreeMap<String, String>, f64)> {
    text.lines()
        .filter_map(|line| {
            let rest = line.strip_prefix(prefix)?;
            let (labels, value) = rest.rsplit_once("} ")?;
            let map = labels
                .split("\",")
                .filter_map(|kv| {
                    let (k, v) = kv.split_once("=\"")?;
                    Some((k.trim().to_string(), v.trim_end_matches('"').to_string()))
                })
                .collect();
            Some((map, value.trim().parse().ok()?))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_counts_by_route_and_outcome() {
        let text = "# TYPE idemproxy_requests counter\nidemproxy_requests_total{route=\"pay\",outcome=\"forwarded\"} 3\nidemproxy_requests_total{route=\"pay\",outcome=\"replayed\"} 1\nidemproxy_other_total 4\n";
        let c = request_counts(text);
        assert_eq!(c.get(&("pay".into(), "forwarded".into())), Some(&3));
        assert_eq!(c.get(&("pay".into(), "replayed".into())), Some(&1));
        assert_eq!(c.len(), 2);
    }
}
