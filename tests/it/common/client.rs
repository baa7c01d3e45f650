//! A plain HTTP/1.1 client over a fresh TCP connection per request, able to send both
//! origin-form (base-URL) and absolute-form (forward proxy) request lines.

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Request};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;

#[derive(Debug, Clone)]
pub struct Reply {
    pub status: u16,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Reply {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    pub fn replayed(&self) -> Option<&str> {
        self.header("idempotent-replayed")
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or(serde_json::Value::Null)
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

/// Sends one request to `proxy`. `target` is `/path` or `http://host/path`.
pub async fn send(
    proxy: SocketAddr,
    method: &str,
    target: &str,
    headers: &[(&str, &str)],
    body: impl Into<Bytes>,
) -> Result<Reply, String> {
    let host = target
        .strip_prefix("http://")
        .and_then(|rest| rest.split('/').next())
        .unwrap_or("idemproxy.test");
    let stream = tokio::net::TcpStream::connect(proxy)
        .await
        .map_err(|e| format!("connect: {e}"))?;
    exchange(stream, method, target, host, headers, body.into()).await
}

/// One HTTP/1.1 request over an open stream (TCP, a tunnel, TLS), answered within 30 s.
pub async fn exchange<S>(
    stream: S,
    method: &str,
    target: &str,
    host: &str,
    headers: &[(&str, &str)],
    body: Bytes,
) -> Result<Reply, String>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let exchange = async {
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| format!("handshake: {e}"))?;
        tokio::spawn(conn);
        let mut req = Request::builder()
            .method(method)
            .uri(target)
            .header("host", host);
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let req = req
            .body(Full::new(body))
            .map_err(|e| format!("request: {e}"))?;
        let resp = sender
            .send_request(req)
            .await
            .map_err(|e| format!("send: {e}"))?;
        let (parts, body) = resp.into_parts();
        let body = body
            .collect()
            .await
            .map_err(|e| format!("body: {e}"))?
            .to_bytes();
        Ok(Reply {
            status: parts.status.as_u16(),
            headers: parts.headers,
            body,
        })
    };
    tokio::time::timeout(Duration::from_secs(30), exchange)
        .await
        .unwrap_or_else(|_| Err("timed out after 30s".into()))
}

/// `POST target` with a JSON body and, if given, an `Idempotency-Key`.
pub async fn post(proxy: SocketAddr, target: &str, key: Option<&str>, body: &str) -> Reply {
    let mut headers = vec![
        ("content-type", "application/json"),
        ("authorization", "Bearer sk_test_123"),
    ];
    if let Some(k) = key {
        headers.push(("idempotency-key", k));
    }
    send(proxy, "POST", target, &headers, body.to_string())
        .await
        .unwrap_or_else(|e| panic!("POST {target}: {e}"))
}
