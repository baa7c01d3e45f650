//! `idemproxy demo`: a stand-in provider on this machine that counts the side effects it
//! performs, for trying the proxy in front of it without an account anywhere. Every POST
//! "charges" once and answers with a new id; `GET /effects` says how many it performed.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use tokio::net::TcpListener;

use crate::http::body::{full, Body};

/// Runs the stand-in provider on `listener` until the process ends.
pub async fn stand_in(listener: TcpListener) {
    let effects = Arc::new(AtomicU64::new(0));
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        let effects = effects.clone();
        tokio::spawn(async move {
            let svc = service_fn(move |req| answer(req, effects.clone()));
            let _ = auto::Builder::new(TokioExecutor::new())
                .serve_connection(TokioIo::new(stream), svc)
                .await;
        });
    }
}

async fn answer(
    req: Request<Incoming>,
    effects: Arc<AtomicU64>,
) -> Result<Response<Body>, Infallible> {
    let (method, path) = (req.method().clone(), req.uri().path().to_string());
    let body = req
        .into_body()
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    let (status, json) = match (method, path.as_str()) {
        (Method::GET, "/effects") => (
            StatusCode::OK,
            serde_json::json!({ "effects": effects.load(Ordering::SeqCst) }),
        ),
        (Method::POST, _) => {
            let n = effects.fetch_add(1, Ordering::SeqCst) + 1;
            (
                StatusCode::OK,
                serde_json::json!({
                    "id": format!("ch_{n:04}"),
                    "object": "charge",
                    "request": String::from_utf8_lossy(&body),
                    "effects_so_far": n,
                }),
            )
        }
        _ => (
            StatusCode::OK,
            serde_json::json!({ "object": "list", "data": [] }),
        ),
    };
    let mut resp = Response::new(full(Bytes::from(json.to_string() + "\n")));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    Ok(resp)
}

/// What `idemproxy demo` prints once the proxy listens: the commands to run and what they
/// show.
pub fn instructions(proxy: SocketAddr, provider: SocketAddr, https_host: Option<&str>) -> String {
    let mut out = format!(
        "\nidemproxy demo: a stand-in provider on http://{provider} (it counts what it does), and idemproxy in front of it on http://{proxy}.\n\n\
         In another terminal, charge twice with the same key, then ask the provider how often it charged:\n\n\
         \x20 curl -si http://{proxy}/shop/v1/charges -H 'Idempotency-Key: order-1' -d amount=1500   # Idempotent-Replayed: false\n\
         \x20 curl -si http://{proxy}/shop/v1/charges -H 'Idempotency-Key: order-1' -d amount=1500   # Idempotent-Replayed: true, same body\n\
         \x20 curl -s http://{provider}/effects                                                      # {{\"effects\":1}}\n"
    );
    if let Some(host) = https_host {
        out.push_str(&format!(
            "\nThe same through HTTPS_PROXY (the proxy intercepts {host} with the CA in certs/):\n\n\
             \x20 curl -si --proxy http://{proxy} --cacert certs/ca.pem https://{host}/v1/charges -H 'Idempotency-Key: order-2' -d amount=900\n\
             \x20 (twice: the second says Idempotent-Replayed: true)\n"
        ));
    }
    out.push_str("\nStop with Ctrl-C.\n");
    out
}
