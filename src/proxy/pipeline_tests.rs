//! The pipeline of one protected request with no sockets: the app as `serve` assembles it,
//! over the in-memory store (with injected faults where a test needs them), each route's
//! upstream a scripted provider that counts what reached it, and tokio's clock paused, so a
//! lease or a lookup's wait passes in no real time. One module per behaviour: the order of
//! the stages, fail-open, reconcile, spend given back. The same behaviours run end to end,
//! over real stores and real providers, in tests/it.

use std::collections::VecDeque;
use std::path::Path;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use futures_util::future::BoxFuture;
use http::{HeaderMap, Method, Request, Response};
use http_body_util::{BodyExt, Full};

use super::pipeline::{self, Target};
use super::App;
use crate::app::{assemble, Parts};
use crate::config::Config;
use crate::http::body::{read_limited, Body};
use crate::idempotency::claims::Claims;
use crate::idempotency::store::{Clock, Store};
use crate::idempotency::testing::{Fault, Faulty, MemoryStore, Op};
use crate::identity::DEFAULT_TENANT;
use crate::metrics::Metrics;
use crate::outbound::upstream::{Upstream, UpstreamBody, UpstreamError};
use crate::spend::testing::MemorySpend;

/// What the scripted provider does with the next request that reaches it.
enum Reply {
    Answer(u16, &'static str),
    /// Takes effect, then the connection drops before the answer.
    LostAfterEffect,
    /// Never reached: the connection is refused.
    Unreachable,
    /// Reached, then after the delay fails as if the connection was refused before the
    /// request was sent (nothing happened at the provider).
    SlowThenRefused(std::time::Duration),
}

/// A provider that answers as scripted (`200 {"id":"ch_1"}` once the script runs out) and
/// keeps every request that reached it.
#[derive(Default)]
struct Provider {
    script: Mutex<VecDeque<Reply>>,
    reached: Mutex<Vec<(Method, String)>>,
}

impl Provider {
    fn new() -> Arc<Provider> {
        Arc::new(Provider::default())
    }

    fn then(&self, reply: Reply) {
        lock(&self.script).push_back(reply);
    }

    /// The requests of `method` that reached it.
    fn reached(&self, method: Method) -> usize {
        lock(&self.reached)
            .iter()
            .filter(|(m, _)| *m == method)
            .count()
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Upstream for Provider {
    fn send(
        &self,
        req: Request<Body>,
    ) -> BoxFuture<'_, Result<Response<UpstreamBody>, UpstreamError>> {
        Box::pin(async move {
            let reply = lock(&self.script)
                .pop_front()
                .unwrap_or(Reply::Answer(200, r#"{"id":"ch_1"}"#));
            if let Reply::Unreachable = reply {
                return Err(UpstreamError::Connect(
                    "scripted: connection refused".into(),
                ));
            }
            let target = req.uri().path_and_query().map(|p| p.to_string());
            lock(&self.reached).push((req.method().clone(), target.unwrap_or_default()));
            if let Reply::SlowThenRefused(delay) = reply {
                tokio::time::sleep(delay).await;
                return Err(UpstreamError::Connect(
                    "scripted: refused after a while".into(),
                ));
            }
            match reply {
                Reply::Answer(status, body) => Ok(Response::builder()
                    .status(status)
                    .header("content-type", "application/json")
                    .body(
                        Full::new(Bytes::from_static(body.as_bytes()))
                            .map_err(|never| match never {})
                            .boxed(),
                    )
                    .expect("a scripted response")),
                _ => Err(UpstreamError::Failed(
                    "scripted: connection reset after the request".into(),
                )),
            }
        })
    }
}

/// The app `serve` would run on `routes` (TOML), with `provider` behind every route and
/// `store` holding the claims, on tokio's clock.
fn app(routes: &str, provider: Arc<Provider>, store: Arc<dyn Store>) -> Arc<App> {
    // Parsed, never opened: the claims live in `store`.
    let text = format!("[store]\nurl = \"sqlite://unused.db\"\n\n{routes}");
    let config = Config::parse(&text, Path::new("pipeline-test.toml")).expect("test config");
    let mut parts = Parts::check(&config).expect("test config builds");
    parts.routes = parts.routes.with_upstream(provider);
    let claims = Claims::new(store).with_clock(Clock::tokio());
    let spend = Arc::new(MemorySpend::new());
    assemble(&config, parts, claims, spend, Arc::new(Metrics::new())).0
}

fn memory() -> Arc<dyn Store> {
    MemoryStore::new(Clock::tokio())
}

/// A route `pay` at `/pay`, with `options` in its block.
fn route(options: &str) -> String {
    format!("[[routes]]\nname = \"pay\"\nprefix = \"/pay\"\nupstream = \"http://pay.test\"\n{options}\n")
}

struct Answer {
    status: u16,
    headers: HeaderMap,
    body: Bytes,
}

/// A POST through the pipeline, routed as the listener would route `path`.
async fn post(app: &App, path: &str, headers: &[(&str, &str)], body: &str) -> Answer {
    let mut req = Request::post(path);
    for (name, value) in headers {
        req = req.header(*name, *value);
    }
    let req = req
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .expect("a test request");
    let (route, rest) = app.routes.by_prefix(path).expect("a route for the path");
    let target = Target {
        uri: route.upstream_uri(rest).expect("an upstream URI"),
        as_sent: None,
    };
    let resp = pipeline::run(app, &route, req, target, DEFAULT_TENANT).await;
    answer_of(resp).await
}

/// A response read whole, as a client gets it.
async fn answer_of(resp: Response<Body>) -> Answer {
    let (parts, body) = resp.into_parts();
    let body = read_limited(body, 1 << 20)
        .await
        .map_err(|e| e.to_string())
        .expect("the whole answer");
    Answer {
        status: parts.status.as_u16(),
        headers: parts.headers,
        body,
    }
}

fn header<'a>(a: &'a Answer, name: &str) -> Option<&'a str> {
    a.headers.get(name).and_then(|v| v.to_str().ok())
}

mod stage_order {
    use super::*;

    /// Claim before forward: the retry is answered from the claim's receipt, byte for byte,
    /// and never reaches the provider.
    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn a_retry_is_answered_from_the_claim_and_never_forwarded() {
        let provider = Provider::new();
        let app = app(&route(""), provider.clone(), memory());
        let key = [("idempotency-key", "k1")];
        let first = post(&app, "/pay/v1/charges", &key, r#"{"amount":100}"#).await;
        let retry = post(&app, "/pay/v1/charges", &key, r#"{"amount":100}"#).await;
        assert_eq!((first.status, retry.status), (200, 200));
        assert_eq!(retry.body, first.body);
        assert_eq!(header(&retry, "idempotent-replayed"), Some("true"));
        assert_eq!(provider.reached(Method::POST), 1);
    }

    /// Identify before claim, claim before forward: a key reused for another request is
    /// refused from the claim, and the provider sees the first request only.
    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn a_key_reused_for_another_request_is_refused_before_the_provider() {
        let provider = Provider::new();
        let app = app(&route(""), provider.clone(), memory());
        let key = [("idempotency-key", "k1")];
        let first = post(&app, "/pay/v1/charges", &key, r#"{"amount":100}"#).await;
        let other = post(&app, "/pay/v1/charges", &key, r#"{"amount":999}"#).await;
        assert_eq!((first.status, other.status), (200, 422));
        assert_eq!(provider.reached(Method::POST), 1);
    }
}

mod fail_open {
    use super::*;

    /// The store's insert fails and it holds no claim: with `fail_open` the request goes
    /// out unprotected, and says so.
    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn a_store_out_of_reach_forwards_unprotected_when_the_route_says_so() {
        let provider = Provider::new();
        let store = Faulty::new(memory());
        store.then(Op::Insert, Fault::Fail);
        let app = app(&route("fail_open = true"), provider.clone(), store);
        let a = post(&app, "/pay/v1/charges", &[("idempotency-key", "k1")], "{}").await;
        assert_eq!(a.status, 200);
        let warning = header(&a, "x-idemproxy-warning").unwrap_or_default();
        assert!(
            warning.starts_with("unprotected: store unavailable"),
            "{warning}"
        );
        assert_eq!(provider.reached(Method::POST), 1);
    }

    /// A priced operation never fails open: its caps, approvals and freezes need the
    /// store. With `fail_open` on a capped route and the store out of reach, a payment far
    /// above its cap is a 503 and nothing reaches the provider.
    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn a_priced_operation_never_fails_open() {
        let provider = Provider::new();
        let store = Faulty::new(memory());
        store.then(Op::Insert, Fault::Fail);
        let capped = "fail_open = true\nhonours_key = false\n[routes.spend]\noperations = [\"POST /v1/payments\"]\namount = [\"{body.amount}\"]\ncurrency = \"usd\"\nunit = \"minor\"\ncaps_currency = \"usd\"\nper_request = \"10.00\"\n";
        let app = app(&route(capped), provider.clone(), store);
        let key = [("idempotency-key", "k1")];
        let a = post(&app, "/pay/v1/payments", &key, r#"{"amount":10003599}"#).await;
        assert_eq!(a.status, 503, "{:?}", a.body);
        assert!(header(&a, "x-idemproxy-warning").is_none());
        assert_eq!(provider.reached(Method::POST), 0);
    }

    /// Without `fail_open` the same failure is a 503, and nothing is forwarded.
    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn a_store_out_of_reach_forwards_nothing_by_default() {
        let provider = Provider::new();
        let store = Faulty::new(memory());
        store.then(Op::Insert, Fault::Fail);
        let app = app(&route(""), provider.clone(), store);
        let a = post(&app, "/pay/v1/charges", &[("idempotency-key", "k1")], "{}").await;
        assert_eq!(a.status, 503);
        assert_eq!(provider.reached(Method::POST), 0);
    }
}

mod reconcile {
    use super::*;

    const LOOKUP: &str = "honours_key = false\ntimeout = \"3s\"\nlease = \"4s\"\n[routes.lookup]\nrequest = \"GET /v1/charges/search?key={key}\"\nfound = [\"200\"]\nnot_found = [\"404\"]\nafter = \"2s\"\n";

    /// A call lost after its effect is held; once the call's deadline and the lookup's wait
    /// have passed (paused time: no real wait), a retry asks the provider, which finds the
    /// charge: that answer is the receipt, and the charge is never made twice.
    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn a_held_call_is_looked_up_and_its_answer_replayed() {
        let provider = Provider::new();
        let app = app(&route(LOOKUP), provider.clone(), memory());
        let key = [("idempotency-key", "k1")];
        provider.then(Reply::LostAfterEffect);
        let lost = post(&app, "/pay/v1/charges", &key, "{}").await;
        assert_eq!(lost.status, 502);
        // Too early to ask: the call could still be running.
        let early = post(&app, "/pay/v1/charges", &key, "{}").await;
        assert_eq!(early.status, 409);
        assert_eq!(provider.reached(Method::GET), 0);
        tokio::time::advance(std::time::Duration::from_secs(10)).await;
        provider.then(Reply::Answer(200, r#"{"id":"ch_found"}"#));
        let retry = post(&app, "/pay/v1/charges", &key, "{}").await;
        assert_eq!(retry.status, 200);
        assert_eq!(retry.body, Bytes::from_static(br#"{"id":"ch_found"}"#));
        assert_eq!(header(&retry, "idempotent-replayed"), Some("true"));
        assert_eq!(provider.reached(Method::GET), 1);
        assert_eq!(provider.reached(Method::POST), 1);
    }
}

mod spend_release {
    use super::*;

    const CAPPED: &str = "honours_key = false\n[routes.spend]\noperations = [\"POST /v1/payments\"]\namount = [\"{body.amount}\"]\ncurrency = \"usd\"\nunit = \"minor\"\ncaps_currency = \"usd\"\nper_run = \"100.00\"\n";

    /// `default.r1:x` as the proxy user: run `r1` of the default tenant.
    const RUN: &str = "Basic ZGVmYXVsdC5yMTp4";

    async fn pay(app: &App, key: &str) -> Answer {
        let headers = [("idempotency-key", key), ("proxy-authorization", RUN)];
        post(app, "/pay/v1/payments", &headers, r#"{"amount":8000}"#).await
    }

    /// A payment that never reached the provider gives its reservation back: the run's next
    /// payment fits under the cap. The one after that does not: the cap holds.
    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn a_payment_that_never_went_out_gives_its_budget_back() {
        let provider = Provider::new();
        let app = app(&route(CAPPED), provider.clone(), memory());
        provider.then(Reply::Unreachable);
        let refused = pay(&app, "p1").await;
        assert_eq!(refused.status, 502, "{:?}", refused.body);
        let second = pay(&app, "p2").await;
        assert_eq!(second.status, 200, "{:?}", second.body);
        let third = pay(&app, "p3").await;
        assert!(
            (400..500).contains(&third.status),
            "{} {:?}",
            third.status,
            third.body
        );
        assert_eq!(provider.reached(Method::POST), 1);
    }

    /// A client that hangs up mid-call leaves the reservation as the claim's outcome says:
    /// the call then fails before anything happened, the claim's own task gives the budget
    /// back, and the run's next payment fits under the cap.
    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn a_client_hanging_up_mid_call_leaves_the_reservation_to_the_outcome() {
        let provider = Provider::new();
        let app = app(&route(CAPPED), provider.clone(), memory());
        provider.then(Reply::SlowThenRefused(std::time::Duration::from_secs(5)));
        let reached = async {
            while provider.reached(Method::POST) == 0 {
                tokio::time::sleep(std::time::Duration::from_millis(10)).await;
            }
        };
        // The client's request is dropped once its call reached the provider.
        tokio::select! {
            a = pay(&app, "p1") => panic!("answered before the call ended: {}", a.status),
            () = reached => {}
        }
        // The call goes on in the claim's task, fails, and settles there.
        tokio::time::sleep(std::time::Duration::from_secs(6)).await;
        let second = pay(&app, "p2").await;
        assert_eq!(second.status, 200, "{:?}", second.body);
        assert_eq!(provider.reached(Method::POST), 2);
    }
}

/// The MCP front, with no sockets: the same driver under a tool call.
mod mcp_front {
    use super::*;

    const TOOLS: &str = "[[routes]]\nname = \"tools\"\nprefix = \"/tools\"\nupstream = \"http://mcp.test\"\nprotocol = \"mcp\"\nfail_open = true\n[routes.mcp]\n[routes.spend]\noperations = [\"refund\"]\namount = [\"{args.amount}\"]\ncurrency = \"usd\"\nunit = \"minor\"\ncaps_currency = \"usd\"\nper_request = \"10.00\"\n";

    /// A `tools/call` of `tool` with `arguments`, JSON-RPC id `id`, through the MCP front.
    async fn call(app: &App, tool: &str, arguments: &str, id: u32) -> Answer {
        let body = format!(
            r#"{{"jsonrpc":"2.0","id":{id},"method":"tools/call","params":{{"name":"{tool}","arguments":{arguments}}}}}"#
        );
        let req = Request::post("/tools/mcp")
            .header("content-type", "application/json")
            .header("accept", "application/json, text/event-stream")
            .body(Full::new(Bytes::from(body)))
            .expect("a test request");
        let (route, rest) = app.routes.by_prefix("/tools/mcp").expect("the MCP route");
        let rules = route.mcp.as_ref().expect("MCP rules");
        let resp = super::super::mcp::run(app, &route, rules, req, rest, DEFAULT_TENANT).await;
        answer_of(resp).await
    }

    fn json(a: &Answer) -> serde_json::Value {
        serde_json::from_slice(&a.body).unwrap_or_default()
    }

    /// A priced tool never fails open: the store out of reach on a route with `fail_open`
    /// answers its call with a JSON-RPC error, and nothing reaches the server; a tool the
    /// route does not price goes through unprotected, and says so.
    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn a_priced_tool_never_fails_open() {
        let provider = Provider::new();
        let store = Faulty::new(memory());
        store.then(Op::Insert, Fault::Fail);
        store.then(Op::Insert, Fault::Fail);
        let app = app(TOOLS, provider.clone(), store);
        let refund = call(&app, "refund", r#"{"amount":10003599}"#, 1).await;
        assert!(json(&refund).get("error").is_some(), "{:?}", refund.body);
        assert_eq!(provider.reached(Method::POST), 0);
        provider.then(Reply::Answer(
            200,
            r#"{"jsonrpc":"2.0","id":2,"result":{"content":[]}}"#,
        ));
        let email = call(&app, "send_email", r#"{"to":"a@example.test"}"#, 2).await;
        assert!(json(&email).get("result").is_some(), "{:?}", email.body);
        let warning = header(&email, "x-idemproxy-warning").unwrap_or_default();
        assert!(
            warning.starts_with("unprotected: store unavailable"),
            "{warning}"
        );
        assert_eq!(provider.reached(Method::POST), 1);
    }

    /// A re-run with a new JSON-RPC id is answered from the claim with its own id, and the
    /// server ran the tool once; a priced call over its cap is refused before the server.
    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn a_rerun_replays_and_a_call_over_its_cap_never_goes_out() {
        let provider = Provider::new();
        let app = app(TOOLS, provider.clone(), memory());
        provider.then(Reply::Answer(
            200,
            r#"{"jsonrpc":"2.0","id":1,"result":{"content":[{"type":"text","text":"sent"}]}}"#,
        ));
        let first = call(&app, "send_email", r#"{"to":"a@example.test"}"#, 1).await;
        let rerun = call(&app, "send_email", r#"{"to":"a@example.test"}"#, 7).await;
        assert_eq!(
            json(&first)["result"]["content"],
            json(&rerun)["result"]["content"],
            "{:?}",
            rerun.body
        );
        assert_eq!(
            json(&rerun)["result"]["_meta"]["io.idemproxy/replay"]["replayed"],
            serde_json::json!(true)
        );
        assert_eq!(json(&rerun)["id"], serde_json::json!(7));
        let over = call(&app, "refund", r#"{"amount":5000}"#, 3).await;
        assert!(json(&over).get("error").is_some(), "{:?}", over.body);
        assert_eq!(provider.reached(Method::POST), 1);
    }
}
