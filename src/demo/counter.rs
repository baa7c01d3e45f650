//! The demo's generic stand-in provider: it counts the side effects it performs. Every POST
//! "charges" once and answers with a new id; `GET /effects` says how many it performed.

use std::convert::Infallible;
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
