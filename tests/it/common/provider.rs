//! A fake provider: a real HTTP server that performs "side effects" and counts them.
//!
//! By default every request performs one effect and answers 200 with a JSON body that carries
//! a unique id and a random nonce, so a replay can be told from a second execution by bytes.
//! Tests queue behaviours (fail, slow, drop the connection after the effect…) that apply to
//! the next requests in order.

use std::collections::{HashMap, VecDeque};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Request, Response, StatusCode};
use http_body_util::{combinators::BoxBody, BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use tokio::net::TcpListener;

type Body = BoxBody<Bytes, std::io::Error>;

#[derive(Debug, Clone)]
pub enum Behavior {
    /// Perform the effect, answer 200.
    Ok,
    /// Perform the effect, answer with this status.
    EffectThenStatus(u16),
    /// Answer with this status without performing anything (429, 503, a 500 that failed early).
    FailWithoutEffect(u16),
    /// Perform the effect, then close the connection without answering.
    DropAfterEffect,
    /// Wait, then behave as `Ok`.
    Slow(Duration),
    /// Answer this status and JSON body without performing anything (e.g. a provider's
    /// "this key was already used" rejection).
    Answer(u16, &'static str),
    /// Perform the effect at once, then wait before answering 200 (a slow response to a
    /// request that already took effect).
    EffectThenSlow(Duration),
}

#[derive(Debug, Clone)]
pub struct Received {
    pub method: String,
    pub path_and_query: String,
    pub headers: HeaderMap,
    pub body: Bytes,
}

#[derive(Default)]
struct State {
    queue: VecDeque<Behavior>,
    effects: Vec<Received>,
    received: Vec<Received>,
    /// Provider-side idempotency (Stripe-like): key → stored response.
    by_key: HashMap<String, (u16, Bytes)>,
    /// Every effect's answer by the `idempotency-key` it carried, for `GET /v1/lookup/{key}`
    /// (a provider that lets clients look an operation up by their own id).
    done_by_key: HashMap<String, (u16, Bytes)>,
    next_id: u64,
}

#[derive(Clone, Default)]
pub struct ProviderOptions {
    /// When set, the provider deduplicates on this header like Stripe: the same key gets the
    /// first response again, with no new effect.
    pub honours_key_header: Option<String>,
}

#[derive(Clone)]
pub struct FakeProvider {
    pub addr: SocketAddr,
    state: Arc<Mutex<State>>,
}

impl FakeProvider {
    pub async fn start() -> FakeProvider {
        Self::start_with(ProviderOptions::default()).await
    }

    pub async fn start_with(opts: ProviderOptions) -> FakeProvider {
        Self::start_inner(opts, None).await
    }

    /// The same provider behind TLS (`tls` from `pki::TestPki::server_config`); serves
    /// HTTP/1.1 and HTTP/2 by ALPN.
    pub async fn start_https(
        opts: ProviderOptions,
        tls: Arc<rustls::ServerConfig>,
    ) -> FakeProvider {
        Self::start_inner(opts, Some(tokio_rustls::TlsAcceptor::from(tls))).await
    }

    async fn start_inner(
        opts: ProviderOptions,
        tls: Option<tokio_rustls::TlsAcceptor>,
    ) -> FakeProvider {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind provider");
        let addr = listener.local_addr().expect("provider addr");
        let state = Arc::new(Mutex::new(State::default()));
        let provider = FakeProvider { addr, state };
        let p = provider.clone();
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let p = p.clone();
                let opts = opts.clone();
                let tls = tls.clone();
                tokio::spawn(async move {
                    let svc = service_fn(move |req| {
                        let p = p.clone();
                        let opts = opts.clone();
                        async move { p.serve(req, &opts).await }
                    });
                    let builder = auto::Builder::new(TokioExecutor::new());
                    match tls {
                        None => {
                            let _ = builder.serve_connection(TokioIo::new(stream), svc).await;
                        }
                        Some(acceptor) => {
                            if let Ok(stream) = acceptor.accept(stream).await {
                                let _ = builder.serve_connection(TokioIo::new(stream), svc).await;
                            }
                        }
                    }
                });
            }
        });
        provider
    }

    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    /// Queues behaviours for the next requests, in order.
    pub fn then(&self, behaviors: impl IntoIterator<Item = Behavior>) {
        self.lock().queue.extend(behaviors);
    }

    /// Drops every queued behaviour: from now on every request behaves as `Ok`.
    pub fn calm(&self) {
        self.lock().queue.clear();
    }

    /// Side effects performed so far.
    pub fn effects(&self) -> usize {
        self.lock().effects.len()
    }

    pub fn effect_list(&self) -> Vec<Received> {
        self.lock().effects.clone()
    }

    /// The response the provider keeps for a key it deduplicates on.
    pub fn stored_response(&self, key: &str) -> Option<(u16, Bytes)> {
        self.lock().by_key.get(key).cloned()
    }

    /// Requests received so far (with or without effect).
    pub fn received(&self) -> Vec<Received> {
        self.lock().received.clone()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    async fn serve(
        &self,
        req: Request<Incoming>,
        opts: &ProviderOptions,
    ) -> Result<Response<Body>, std::io::Error> {
        let (parts, body) = req.into_parts();
        let body = body
            .collect()
            .await
            .map_err(std::io::Error::other)?
            .to_bytes();
        let received = Received {
            method: parts.method.to_string(),
            path_and_query: parts
                .uri
                .path_and_query()
                .map(|p| p.to_string())
                .unwrap_or_default(),
            headers: parts.headers.clone(),
            body: body.clone(),
        };
        self.lock().received.push(received.clone());

        if parts.uri.path() == "/stream" {
            return Ok(stream_response(&received));
        }
        if let Some(asked) = parts.uri.path().strip_prefix("/v1/lookup/") {
            let found = self.lock().done_by_key.get(asked).cloned();
            return Ok(match found {
                Some((status, body)) => json(status, body, None),
                None => json(404, Bytes::from_static(br#"{"error":"not_found"}"#), None),
            });
        }
        if parts.method == http::Method::GET {
            return Ok(json(
                200,
                serde_json::json!({"object": "list", "data": []})
                    .to_string()
                    .into(),
                None,
            ));
        }

        let behavior = self.lock().queue.pop_front().unwrap_or(Behavior::Ok);
        if let Some(ms) = header(&parts.headers, "x-fake-delay-ms").and_then(|v| v.parse().ok()) {
            tokio::time::sleep(Duration::from_millis(ms)).await;
        }
        let status = match behavior {
            Behavior::FailWithoutEffect(status) => {
                return Ok(json(
                    status,
                    Bytes::from_static(br#"{"error":{"type":"api_error"}}"#),
                    None,
                ));
            }
            Behavior::Answer(status, body) => {
                return Ok(json(status, Bytes::from_static(body.as_bytes()), None));
            }
            Behavior::Slow(d) => {
                tokio::time::sleep(d).await;
                200
            }
            Behavior::EffectThenStatus(s) => s,
            Behavior::Ok | Behavior::DropAfterEffect | Behavior::EffectThenSlow(_) => 200,
        };

        let key = opts
            .honours_key_header
            .as_deref()
            .and_then(|h| header(&parts.headers, h));
        let (status, body, replayed) = {
            let mut st = self.lock();
            match key.as_ref().and_then(|k| st.by_key.get(k).cloned()) {
                Some((status, body)) => (status, body, true),
                None => {
                    st.next_id += 1;
                    let body = serde_json::json!({
                        "id": format!("ch_{}", st.next_id),
                        "object": "charge",
                        "nonce": format!("{:016x}", rand::random::<u64>()),
                        "idempotency_key": key,
                    })
                    .to_string();
                    let body = Bytes::from(body);
                    if let Some(k) = header(&parts.headers, "idempotency-key") {
                        // The operation exists whatever its answer said (a 500 after the effect).
                        st.done_by_key.insert(k, (200, body.clone()));
                    }
                    st.effects.push(received);
                    if let Some(k) = key {
                        st.by_key.insert(k, (status, body.clone()));
                    }
                    (status, body, false)
                }
            }
        };
        if let Behavior::EffectThenSlow(d) = behavior {
            tokio::time::sleep(d).await;
        }
        if matches!(behavior, Behavior::DropAfterEffect) {
            // Returning an error makes hyper close the connection without a response.
            return Err(std::io::Error::other(
                "fake provider drops the connection after the effect",
            ));
        }
        let keyed = parts.headers.keys().any(|k| k.as_str().contains("key"));
        Ok(json(status, body, keyed.then_some(replayed)))
    }
}

fn header(h: &HeaderMap, name: &str) -> Option<String> {
    h.get(name).and_then(|v| v.to_str().ok()).map(String::from)
}

fn json(status: u16, body: Bytes, replayed: Option<bool>) -> Response<Body> {
    let mut resp = Response::new(
        Full::new(body)
            .map_err(|never: Infallible| match never {})
            .boxed(),
    );
    *resp.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let h = resp.headers_mut();
    h.insert(
        "content-type",
        http::HeaderValue::from_static("application/json"),
    );
    h.insert(
        "request-id",
        http::HeaderValue::from_str(&format!("req_{:08x}", rand::random::<u32>())).expect("hex"),
    );
    // Stripe sends its own marker on keyed requests; the proxy must not let it through next
    // to its own.
    if let Some(replayed) = replayed {
        h.insert(
            "idempotent-replayed",
            http::HeaderValue::from_static(if replayed { "true" } else { "false" }),
        );
    }
    resp
}

/// `GET /stream?n=N&ms=M`: N chunks, M ms apart (server-sent-events style).
fn stream_response(req: &Received) -> Response<Body> {
    let query: HashMap<String, String> = req
        .path_and_query
        .split_once('?')
        .map(|(_, q)| {
            q.split('&')
                .filter_map(|kv| kv.split_once('='))
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        })
        .unwrap_or_default();
    let n: u32 = query.get("n").and_then(|v| v.parse().ok()).unwrap_or(5);
    let ms: u64 = query.get("ms").and_then(|v| v.parse().ok()).unwrap_or(100);
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Frame<Bytes>, std::io::Error>>(4);
    tokio::spawn(async move {
        for i in 0..n {
            if tx
                .send(Ok(Frame::data(Bytes::from(format!("data: {i}\n\n")))))
                .await
                .is_err()
            {
                return;
            }
            tokio::time::sleep(Duration::from_millis(ms)).await;
        }
    });
    let stream = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|item| (item, rx))
    });
    let mut resp = Response::new(BodyExt::boxed(StreamBody::new(stream)));
    resp.headers_mut().insert(
        "content-type",
        http::HeaderValue::from_static("text/event-stream"),
    );
    resp
}
