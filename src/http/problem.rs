//! Every answer the proxy makes itself, on the proxy and the admin listener alike: an RFC 9457
//! `application/problem+json` body whose `type` is `urn:idemproxy:problem:<slug>`, a `detail`
//! that says what happened and what to do, and an `X-Idemproxy-Error: <slug>` header.

use std::time::Duration;

use http::{header, HeaderName, HeaderValue, Response, StatusCode};

use crate::http::body::{full, Body};

pub const ERROR_HEADER: HeaderName = HeaderName::from_static("x-idemproxy-error");

#[derive(Debug, Clone)]
pub struct Problem {
    pub status: StatusCode,
    /// Stable, machine-readable; the last segment of the problem `type`.
    pub slug: &'static str,
    pub title: &'static str,
    pub detail: String,
    /// Sent as whole seconds, rounded up, never 0: a client retrying at once would only hit
    /// it again.
    pub retry_after: Option<Duration>,
}

impl Problem {
    /// A problem titled by the status's reason phrase.
    pub fn new(status: StatusCode, slug: &'static str, detail: impl Into<String>) -> Problem {
        Problem {
            status,
            slug,
            title: status.canonical_reason().unwrap_or("Error"),
            detail: detail.into(),
            retry_after: None,
        }
    }

    pub fn titled(mut self, title: &'static str) -> Problem {
        self.title = title;
        self
    }

    pub fn retry_after(mut self, after: Option<Duration>) -> Problem {
        self.retry_after = after;
        self
    }

    pub fn body(&self) -> String {
        serde_json::json!({
            "type": format!("urn:idemproxy:problem:{}", self.slug),
            "title": self.title,
            "status": self.status.as_u16(),
            "detail": self.detail,
        })
        .to_string()
    }

    fn retry_after_secs(&self) -> Option<u128> {
        self.retry_after
            .map(|d| d.as_millis().div_ceil(1000).max(1))
    }

    pub fn into_response(self) -> Response<Body> {
        self.respond("application/problem+json", self.body())
    }

    /// The same problem with another JSON body (a provider's error shape): the same status,
    /// `Retry-After` and `X-Idemproxy-Error`.
    pub fn json_response(&self, body: String) -> Response<Body> {
        self.respond("application/json", body)
    }

    fn respond(&self, content_type: &'static str, body: String) -> Response<Body> {
        let mut resp = Response::new(full(body));
        *resp.status_mut() = self.status;
        let h = resp.headers_mut();
        h.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
        h.insert(ERROR_HEADER, HeaderValue::from_static(self.slug));
        if let Some(secs) = self.retry_after_secs() {
            h.insert(header::RETRY_AFTER, HeaderValue::from(secs as u64));
        }
        resp
    }

    /// The whole HTTP/1.1 response as bytes, closing the connection: for answers written
    /// before hyper has a connection (a full listener).
    pub fn to_http1_closing(&self) -> Vec<u8> {
        let body = self.body();
        let mut head = format!(
            "HTTP/1.1 {} {}\r\ncontent-type: application/problem+json\r\nx-idemproxy-error: {}\r\n",
            self.status.as_u16(),
            self.status.canonical_reason().unwrap_or(""),
            self.slug
        );
        if let Some(secs) = self.retry_after_secs() {
            head.push_str(&format!("retry-after: {secs}\r\n"));
        }
        head.push_str(&format!(
            "connection: close\r\ncontent-length: {}\r\n\r\n",
            body.len()
        ));
        head.push_str(&body);
        head.into_bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn head_and_body_agree() {
        let p = Problem::new(StatusCode::SERVICE_UNAVAILABLE, "too-many-connections", "x")
            .retry_after(Some(Duration::from_millis(1)));
        let raw = String::from_utf8(p.to_http1_closing()).expect("ascii");
        let (head, body) = raw.split_once("\r\n\r\n").expect("head and body");
        assert!(head.starts_with("HTTP/1.1 503 Service Unavailable\r\n"));
        assert!(head.contains("retry-after: 1\r\n"));
        assert!(head.contains(&format!("content-length: {}", body.len())));
        let v: serde_json::Value = serde_json::from_str(body).expect("json");
        assert_eq!(v["type"], "urn:idemproxy:problem:too-many-connections");
        let r = p.into_response();
        assert_eq!(r.headers()[header::RETRY_AFTER], "1");
    }
}
