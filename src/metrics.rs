//! Prometheus metrics: what happened to requests (by route and outcome), how long upstreams
//! and the store take, and what is outstanding. Labels never carry keys, scopes or credentials.

use std::time::Instant;

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

type Labels = Vec<(String, String)>;

/// What became of one request on the proxy listener.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RequestOutcome {
    /// Executed at the provider; its answer is the receipt.
    Forwarded,
    Replayed,
    /// Another request with the key is in flight (409).
    Conflict,
    /// The key was reused for another request (422).
    Mismatch,
    /// The outcome is (or was left) unknown; retries are held.
    Unknown,
    /// The claim was released (retryable failure).
    Released,
    /// Refused by the proxy before anything was claimed or forwarded (4xx/5xx it made itself).
    Rejected,
    /// Not protected: streamed through untouched (a method the route does not protect, or no
    /// route at all).
    Passthrough,
    /// A method the route protects, forwarded without protection (no key on a route whose
    /// `missing_key` is `forward`, or a store down with `fail_open`).
    Unprotected,
    /// A CONNECT tunnel.
    Tunnel,
}

impl RequestOutcome {
    pub fn as_str(self) -> &'static str {
        match self {
            RequestOutcome::Forwarded => "forwarded",
            RequestOutcome::Replayed => "replayed",
            RequestOutcome::Conflict => "conflict",
            RequestOutcome::Mismatch => "mismatch",
            RequestOutcome::Unknown => "unknown",
            RequestOutcome::Released => "released",
            RequestOutcome::Rejected => "rejected",
            RequestOutcome::Passthrough => "passthrough",
            RequestOutcome::Unprotected => "unprotected",
            RequestOutcome::Tunnel => "tunnel",
        }
    }
}

pub struct Metrics {
    registry: Registry,
    requests: Family<Labels, Counter>,
    upstream_seconds: Family<Labels, Histogram, fn() -> Histogram>,
    store_seconds: Family<Labels, Histogram, fn() -> Histogram>,
    store_errors: Family<Labels, Counter>,
    minted_keys: Family<Labels, Counter>,
    replays_of_other_requests: Family<Labels, Counter>,
    forwards_refused: Family<Labels, Counter>,
    lookups: Family<Labels, Counter>,
    unknown_resolved: Family<Labels, Counter>,
    spend: Family<Labels, Counter<f64, std::sync::atomic::AtomicU64>>,
    spend_refused: Family<Labels, Counter>,
    spend_shadow: Family<Labels, Counter>,
    approvals: Family<Labels, Counter>,
    approval_notices: Family<Labels, Counter>,
    /// Set at scrape time from the store: approvals waiting for a person.
    pub approvals_pending: Gauge,
    connect_refused: Family<Labels, Counter>,
    tunnels: Family<Labels, Counter>,
    unprotected: Family<Labels, Counter>,
    mcp_probes_refused: Family<Labels, Counter>,
    config_reloads: Family<Labels, Counter>,
    /// Claims this process holds while their upstream call runs.
    pub claims_in_flight: Gauge,
    /// Set at scrape time from the store (shared by every replica).
    pub unknown_claims: Gauge,
    /// Leaf certificates cached for TLS interception; set at scrape time from the cache.
    pub cert_cache_entries: Gauge,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Metrics {
        let mut m = Metrics {
            registry: Registry::with_prefix("idemproxy"),
            requests: Family::default(),
            // 1 ms … ~65 s.
            upstream_seconds: Family::new_with_constructor(|| {
                Histogram::new(exponential_buckets(0.001, 2.0, 17))
            }),
            // 0.1 ms … ~3.3 s.
            store_seconds: Family::new_with_constructor(|| {
                Histogram::new(exponential_buckets(0.0001, 2.0, 16))
            }),
            store_errors: Family::default(),
            minted_keys: Family::default(),
            replays_of_other_requests: Family::default(),
            forwards_refused: Family::default(),
            lookups: Family::default(),
            unknown_resolved: Family::default(),
            spend: Family::default(),
            spend_refused: Family::default(),
            spend_shadow: Family::default(),
            approvals: Family::default(),
            approval_notices: Family::default(),
            approvals_pending: Gauge::default(),
            connect_refused: Family::default(),
            tunnels: Family::default(),
            unprotected: Family::default(),
            mcp_probes_refused: Family::default(),
            config_reloads: Family::default(),
            claims_in_flight: Gauge::default(),
            unknown_claims: Gauge::default(),
            cert_cache_entries: Gauge::default(),
        };
        // The exposition lists metrics in the order they are registered.
        m.register_requests();
        m.register_store();
        m.register_claims();
        m.register_spend();
        m.register_connect_and_reload();
        m.register_outstanding();
        m
    }

    fn register_requests(&mut self) {
        let r = &mut self.registry;
        r.register(
            "requests",
            "Requests on the proxy listener by route and outcome",
            self.requests.clone(),
        );
        r.register(
            "upstream_duration_seconds",
            "Upstream call duration (send and whole response) by route",
            self.upstream_seconds.clone(),
        );
    }

    fn register_store(&mut self) {
        let r = &mut self.registry;
        r.register(
            "store_operation_duration_seconds",
            "Store operation duration by operation",
            self.store_seconds.clone(),
        );
        r.register(
            "store_errors",
            "Store operations that failed or timed out, by operation",
            self.store_errors.clone(),
        );
    }

    fn register_claims(&mut self) {
        let r = &mut self.registry;
        r.register("client_minted_keys", "Requests for an operation seen shortly before under another client key: the client mints a key per call, so its key cannot catch a re-run. By route", self.minted_keys.clone());
        r.register("replays_of_reworded_requests", "Receipts of a derived operation replayed to a request whose details differ from the first (an agent re-run that reworded the call). By route", self.replays_of_other_requests.clone());
        r.register("forwards_refused", "Protected requests refused before anything was claimed because server.max_forwards or server.max_forward_bytes was reached, by limit", self.forwards_refused.clone());
        r.register(
            "lookups",
            "Lookups at the provider for held operations, by route and verdict (found, not_found, unclear)",
            self.lookups.clone(),
        );
        r.register(
            "unknown_resolved",
            "Held (UNKNOWN) operations resolved, by route and by whom: lookup (the provider was asked), operator (the admin API), expired (the hold ended and a retry executed)",
            self.unknown_resolved.clone(),
        );
    }

    fn register_spend(&mut self) {
        let r = &mut self.registry;
        r.register(
            "spend",
            "Money sent to providers (reservations kept: the payment happened or may have), in major units, by route, tenant and currency",
            self.spend.clone(),
        );
        r.register(
            "spend_refused",
            "Payments refused by a spend cap, by route and cap (per_request, per_run, per_tenant, count_per_run, …, and frozen); every cap a route has is shown from the start",
            self.spend_refused.clone(),
        );
        r.register(
            "spend_shadow",
            "Shadow mode (enforce = false): requests spend control would have refused or parked, which went out, by route and cap",
            self.spend_shadow.clone(),
        );
        r.register(
            "approvals",
            "Approvals by route and event: requested, approved, denied, expired",
            self.approvals.clone(),
        );
        r.register(
            "approval_notices",
            "Approval notices to the webhook, by result: sent, failed (after every retry), dropped (queue full)",
            self.approval_notices.clone(),
        );
        r.register(
            "approvals_pending",
            "Approvals waiting for a person (read from the store at each scrape)",
            self.approvals_pending.clone(),
        );
    }

    fn register_connect_and_reload(&mut self) {
        let r = &mut self.registry;
        r.register(
            "connect_refused",
            "CONNECT requests refused, and intercepted tunnels whose client broke off the TLS handshake, by reason (see docs/troubleshooting.md)",
            self.connect_refused.clone(),
        );
        r.register(
            "tunnels",
            "Blind tunnels spliced, by what their client sent first: sni_match (a ClientHello naming the CONNECT host), sni_other (another unrouted name), no_sni, ech, not_tls, unparsed (no well-formed ClientHello within the bound), server_first (nothing within tls.peek_timeout, then first bytes that are not TLS)",
            self.tunnels.clone(),
        );
        r.register(
            "unprotected_requests",
            "Protected methods forwarded without a claim, by route and reason: no_key (no key and no template field to derive one) or store_unavailable (fail_open)",
            self.unprotected.clone(),
        );
        r.register(
            "mcp_annotation_probes_refused",
            "An MCP route's tools/list probes (trust_annotations) that failed, by route: the server refused or could not be read, so every tool of that endpoint is treated as protected (its read-only tools answered from receipts)",
            self.mcp_probes_refused.clone(),
        );
        r.register(
            "config_reloads",
            "Config reloads (SIGHUP or the admin API) by result: applied, invalid (the file does not validate), needs_restart (a section only a restart applies changed)",
            self.config_reloads.clone(),
        );
    }

    fn register_outstanding(&mut self) {
        let r = &mut self.registry;
        r.register(
            "claims_in_flight",
            "Claims this process holds while their upstream call runs",
            self.claims_in_flight.clone(),
        );
        r.register("unknown_claims", "UNKNOWN claims in the store waiting for an operator or their hold (capped at the admin list limit)", self.unknown_claims.clone());
        r.register(
            "cert_cache_entries",
            "Leaf certificates cached for TLS interception",
            self.cert_cache_entries.clone(),
        );
    }

    pub fn request(&self, route: &str, outcome: RequestOutcome) {
        self.requests
            .get_or_create(&vec![
                ("route".into(), route.into()),
                ("outcome".into(), outcome.as_str().into()),
            ])
            .inc();
    }

    pub fn minted_key(&self, route: &str) {
        self.minted_keys
            .get_or_create(&vec![("route".into(), route.into())])
            .inc();
    }

    pub fn replay_of_reworded_request(&self, route: &str) {
        self.replays_of_other_requests
            .get_or_create(&vec![("route".into(), route.into())])
            .inc();
    }

    pub fn forward_refused(&self, limit: &'static str) {
        self.forwards_refused
            .get_or_create(&vec![("limit".into(), limit.into())])
            .inc();
    }

    pub fn lookup(&self, route: &str, verdict: &'static str) {
        self.lookups
            .get_or_create(&vec![
                ("route".into(), route.into()),
                ("verdict".into(), verdict.into()),
            ])
            .inc();
    }

    pub fn unknown_resolved(&self, route: &str, by: &'static str) {
        self.unknown_resolved
            .get_or_create(&vec![
                ("route".into(), route.into()),
                ("by".into(), by.into()),
            ])
            .inc();
    }

    /// A payment that went out: `amount` in major units of `currency`.
    pub fn spent(&self, route: &str, tenant: &str, currency: &str, amount: f64) {
        self.spend
            .get_or_create(&vec![
                ("route".into(), route.into()),
                ("tenant".into(), tenant.into()),
                ("currency".into(), currency.into()),
            ])
            .inc_by(amount);
    }

    /// The spend refusals and shadowed decisions a route's caps can count, each shown at 0
    /// from the start: an alert on a cap exists before the first refusal does.
    pub fn spend_caps(&self, route: &str, caps: &[&'static str]) {
        for cap in caps {
            let labels = vec![
                ("route".into(), route.into()),
                ("cap".into(), (*cap).into()),
            ];
            drop(self.spend_refused.get_or_create(&labels));
            drop(self.spend_shadow.get_or_create(&labels));
        }
    }

    pub fn spend_refused(&self, route: &str, cap: &'static str) {
        self.spend_refused
            .get_or_create(&vec![
                ("route".into(), route.into()),
                ("cap".into(), cap.into()),
            ])
            .inc();
    }

    pub fn spend_shadow(&self, route: &str, cap: &'static str) {
        self.spend_shadow
            .get_or_create(&vec![
                ("route".into(), route.into()),
                ("cap".into(), cap.into()),
            ])
            .inc();
    }

    pub fn approval(&self, route: &str, event: &'static str) {
        self.approvals
            .get_or_create(&vec![
                ("route".into(), route.into()),
                ("event".into(), event.into()),
            ])
            .inc();
    }

    pub fn approval_notice(&self, result: &'static str) {
        self.approval_notices
            .get_or_create(&vec![("result".into(), result.into())])
            .inc();
    }

    /// `reason` is one of a fixed set (`ConnectError::reason`, `intercept`): never a host.
    pub fn tunnel(&self, hello: &'static str) {
        self.tunnels
            .get_or_create(&vec![("hello".into(), hello.into())])
            .inc();
    }

    pub fn connect_refused(&self, reason: &'static str) {
        self.connect_refused
            .get_or_create(&vec![("reason".into(), reason.into())])
            .inc();
    }

    pub fn unprotected(&self, route: &str, reason: &'static str) {
        self.unprotected
            .get_or_create(&vec![
                ("route".into(), route.into()),
                ("reason".into(), reason.into()),
            ])
            .inc();
    }

    pub fn mcp_probe_refused(&self, route: &str) {
        self.mcp_probes_refused
            .get_or_create(&vec![("route".into(), route.into())])
            .inc();
    }

    pub fn config_reload(&self, result: &'static str) {
        self.config_reloads
            .get_or_create(&vec![("result".into(), result.into())])
            .inc();
    }

    pub fn upstream(&self, route: &str, seconds: f64) {
        self.upstream_seconds
            .get_or_create(&vec![("route".into(), route.into())])
            .observe(seconds);
    }

    /// Where one store operation's timings go (looked up once: recording allocates nothing).
    pub fn store_op(&self, op: &'static str) -> StoreOp {
        let labels = vec![("op".to_string(), op.to_string())];
        StoreOp {
            seconds: self.store_seconds.get_or_create(&labels).clone(),
            errors: self.store_errors.get_or_create(&labels).clone(),
        }
    }

    /// Prometheus text exposition format.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = encode(&mut out, &self.registry);
        out
    }
}

/// One store operation's duration histogram and error counter.
#[derive(Clone)]
pub struct StoreOp {
    seconds: Histogram,
    errors: Counter,
}

impl StoreOp {
    /// One call: its duration, and whether it failed (or was abandoned).
    pub fn record(&self, started: Instant, ok: bool) {
        self.seconds.observe(started.elapsed().as_secs_f64());
        if !ok {
            self.errors.inc();
        }
    }
}

/// Counts a claim as in flight until dropped (also when the request future is cancelled).
pub struct InFlight<'a>(&'a Metrics);

impl<'a> InFlight<'a> {
    pub fn start(metrics: &'a Metrics) -> InFlight<'a> {
        metrics.claims_in_flight.inc();
        InFlight(metrics)
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.claims_in_flight.dec();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exposition_carries_labels_and_histograms() {
        let m = Metrics::new();
        m.request("pay", RequestOutcome::Replayed);
        m.request("pay", RequestOutcome::Replayed);
        m.upstream("pay", 0.02);
        let text = m.encode();
        assert!(
            text.contains("idemproxy_requests_total{route=\"pay\",outcome=\"replayed\"} 2"),
            "{text}"
        );
        assert!(
            text.contains("idemproxy_upstream_duration_seconds_count{route=\"pay\"} 1"),
            "{text}"
        );
        assert!(text.contains("idemproxy_claims_in_flight 0"), "{text}");
        {
            let _a = InFlight::start(&m);
            assert!(m.encode().contains("idemproxy_claims_in_flight 1"));
        }
        assert!(m.encode().contains("idemproxy_claims_in_flight 0"));
    }
}
