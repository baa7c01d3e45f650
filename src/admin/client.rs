//! A small HTTP/1.1 client for the admin API, used by `idemproxy keys …` and
//! `idemproxy healthcheck` (the container image has no curl).

use std::time::Duration;

use bytes::Bytes;
use http::{header, Method, Request, Uri};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;

#[derive(Debug, thiserror::Error)]
pub enum AdminClientError {
    #[error("`{0}` is not an http:// URL with a host and port")]
    Url(String),
    #[error("cannot reach the admin API at {addr}: {message}")]
    Connect { addr: String, message: String },
    #[error("the admin API did not answer properly: {0}")]
    Exchange(String),
    #[error("the admin API did not answer within {0:?}")]
    Timeout(Duration),
}

pub struct Answer {
    pub status: u16,
    pub body: Bytes,
}

/// Sends one request to `base` + `path` (e.g. `http://127.0.0.1:9090` + `/v1/keys`).
pub async fn call(
    base: &str,
    method: Method,
    path: &str,
    token: Option<&str>,
    body: Option<serde_json::Value>,
) -> Result<Answer, AdminClientError> {
    let url = format!("{}{}", base.trim_end_matches('/'), path);
    let uri: Uri = url
        .parse()
        .map_err(|_| AdminClientError::Url(base.to_string()))?;
    if uri.scheme_str() != Some("http") {
        return Err(AdminClientError::Url(base.to_string()));
    }
    let authority = uri
        .authority()
        .cloned()
        .ok_or_else(|| AdminClientError::Url(base.to_string()))?;
    let addr = format!(
        "{}:{}",
        authority.host(),
        authority.port_u16().unwrap_or(80)
    );
    let timeout = Duration::from_secs(30);
    let exchange = async {
        let stream =
            tokio::net::TcpStream::connect(&addr)
                .await
                .map_err(|e| AdminClientError::Connect {
                    addr: addr.clone(),
                    message: e.to_string(),
                })?;
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| AdminClientError::Exchange(e.to_string()))?;
        tokio::spawn(conn);
        let mut req = Request::builder()
            .method(method)
            .uri(uri.path_and_query().map(|p| p.as_str()).unwrap_or("/"))
            .header(header::HOST, authority.as_str());
        if let Some(t) = token {
            req = req.header(header::AUTHORIZATION, format!("Bearer {t}"));
        }
        let payload = match body {
            Some(v) => {
                req = req.header(header::CONTENT_TYPE, "application/json");
                Bytes::from(v.to_string())
            }
            None => Bytes::new(),
        };
        let req = req
            .body(Full::new(payload))
            .map_err(|e| AdminClientError::Exchange(e.to_string()))?;
        let resp = sender
            .send_request(req)
            .await
            .map_err(|e| AdminClientError::Exchange(e.to_string()))?;
        let status = resp.status().as_u16();
        let body = resp
            .into_body()
            .collect()
            .await
            .map_err(|e| AdminClientError::Exchange(e.to_string()))?
            .to_bytes();
        Ok(Answer { status, body })
    };
    tokio::time::timeout(timeout, exchange)
        .await
        .unwrap_or(Err(AdminClientError::Timeout(timeout)))
}
