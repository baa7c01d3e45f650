//! Every answer the proxy makes itself: one error enum, one mapping to an RFC 9457
//! `application/problem+json` response that says what happened and what to do.

use std::time::Duration;

use http::{header, HeaderValue, Response, StatusCode};

use crate::idempotency::key::KeyError;
use crate::proxy::body::{full, Body};
use crate::proxy::connect::ConnectError;
use crate::proxy::upstream::UpstreamError;
use crate::store::StoreError;

/// What the proxy did with the claim when the upstream call failed; shapes the advice.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClaimAfterFailure {
    /// Not a protected request.
    None,
    /// Released: a retry with the same key executes.
    Released,
    /// UNKNOWN: retries are held.
    Unknown,
    /// The store could not be told; the claim lapses into UNKNOWN when its lease runs out.
    Unsettled,
}

#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    #[error(transparent)]
    InvalidKey(#[from] KeyError),
    #[error("this route requires an idempotency key in the {header} header")]
    MissingKey { header: String },
    #[error("the request has no {header} header and its key template needs {field}, which the request does not carry")]
    MissingKeyField { header: String, field: String },
    #[error("{0}")]
    MalformedBody(String),
    /// The provider answered "this key was already used" instead of replaying: the operation
    /// exists, but its response is not known here.
    #[error("{note}")]
    DuplicateRejected { note: String },
    #[error("the request body is larger than {limit} bytes")]
    BodyTooLarge { limit: usize },
    #[error("{0}")]
    BadRequest(String),
    #[error("no route covers {0}")]
    NoRoute(String),
    #[error("this idempotency key was already used for a different request")]
    KeyReused,
    #[error("a request with this idempotency key is still being processed")]
    InFlight { retry_after: Duration },
    #[error("the outcome of the first request with this idempotency key is unknown")]
    OutcomeUnknown { retry_after: Option<Duration> },
    #[error("the idempotency store is unavailable: {0}")]
    StoreUnavailable(StoreError),
    #[error("{error}")]
    Upstream {
        error: UpstreamError,
        claim: ClaimAfterFailure,
    },
    #[error(transparent)]
    Connect(#[from] ConnectError),
    #[error("egress refused: {0}")]
    EgressRefused(String),
}

impl ProxyError {
    fn status(&self) -> StatusCode {
        match self {
            ProxyError::InvalidKey(_)
            | ProxyError::MissingKey { .. }
            | ProxyError::MissingKeyField { .. }
            | ProxyError::MalformedBody(_)
            | ProxyError::BadRequest(_) => StatusCode::BAD_REQUEST,
            ProxyError::BodyTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            ProxyError::NoRoute(_) => StatusCode::NOT_FOUND,
            ProxyError::KeyReused => StatusCode::UNPROCESSABLE_ENTITY,
            ProxyError::InFlight { .. }
            | ProxyError::OutcomeUnknown { .. }
            | ProxyError::DuplicateRejected { .. } => StatusCode::CONFLICT,
            ProxyError::StoreUnavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
            ProxyError::Upstream {
                error: UpstreamError::Timeout(_),
                ..
            } => StatusCode::GATEWAY_TIMEOUT,
            ProxyError::Upstream { .. } => StatusCode::BAD_GATEWAY,
            ProxyError::Connect(e) => e.status(),
            ProxyError::EgressRefused(_) => StatusCode::FORBIDDEN,
        }
    }

    /// Stable machine-readable name; also the last segment of the problem `type`.
    pub fn slug(&self) -> &'static str {
        match self {
            ProxyError::InvalidKey(_) => "invalid-idempotency-key",
            ProxyError::MissingKey { .. } | ProxyError::MissingKeyField { .. } => {
                "missing-idempotency-key"
            }
            ProxyError::MalformedBody(_) => "malformed-body",
            ProxyError::DuplicateRejected { .. } => "outcome-unknown",
            ProxyError::BodyTooLarge { .. } => "body-too-large",
            ProxyError::BadRequest(_) => "bad-request",
            ProxyError::NoRoute(_) => "no-route",
            ProxyError::KeyReused => "idempotency-key-reused",
            ProxyError::InFlight { .. } => "request-in-flight",
            ProxyError::OutcomeUnknown { .. } => "outcome-unknown",
            ProxyError::StoreUnavailable(_) => "store-unavailable",
            ProxyError::Upstream {
                error: UpstreamError::Tls(_),
                ..
            } => "upstream-tls-failed",
            ProxyError::Upstream {
                error: UpstreamError::Connect(_),
                ..
            } => "upstream-unreachable",
            ProxyError::Upstream {
                error: UpstreamError::Timeout(_),
                ..
            } => "upstream-timeout",
            ProxyError::Upstream {
                error: UpstreamError::ResponseTooLarge(_),
                ..
            } => "upstream-response-too-large",
            ProxyError::Upstream { .. } => "upstream-failed",
            ProxyError::Connect(e) => e.slug(),
            ProxyError::EgressRefused(_) => "egress-refused",
        }
    }

    fn title(&self) -> &'static str {
        match self {
            ProxyError::InvalidKey(_) => "Invalid idempotency key",
            ProxyError::MissingKey { .. } | ProxyError::MissingKeyField { .. } => {
                "Idempotency key required"
            }
            ProxyError::MalformedBody(_) => "Malformed request body",
            ProxyError::DuplicateRejected { .. } => {
                "Outcome unknown: the provider already has this operation"
            }
            ProxyError::BodyTooLarge { .. } => "Request body too large",
            ProxyError::BadRequest(_) => "Bad request",
            ProxyError::NoRoute(_) => "No route",
            ProxyError::KeyReused => "Idempotency key reused with a different request",
            ProxyError::InFlight { .. } => "Request in flight",
            ProxyError::OutcomeUnknown { .. } => "Outcome unknown",
            ProxyError::StoreUnavailable(_) => "Idempotency store unavailable",
            ProxyError::Upstream {
                error: UpstreamError::Tls(_),
                ..
            } => "Upstream certificate rejected",
            ProxyError::Upstream {
                error: UpstreamError::Connect(_),
                ..
            } => "Upstream unreachable",
            ProxyError::Upstream {
                error: UpstreamError::Timeout(_),
                ..
            } => "Upstream timed out",
            ProxyError::Upstream { .. } => "Upstream failed",
            ProxyError::Connect(e) => e.title(),
            ProxyError::EgressRefused(_) => "Destination not allowed",
        }
    }

    fn advice(&self) -> String {
        match self {
            ProxyError::InvalidKey(_) => "Send a key of 1 to 255 visible ASCII characters, e.g. a UUID.".into(),
            ProxyError::MissingKey { .. } => "Add the header with a key that stays the same across retries of this operation.".into(),
            ProxyError::MissingKeyField { header, .. } => format!("Nothing was forwarded or claimed. Add the field, or send a {header} header that stays the same across retries of this operation."),
            ProxyError::MalformedBody(_) => "Nothing was forwarded or claimed. Send a well-formed body.".into(),
            ProxyError::DuplicateRejected { .. } => "Its real response was not kept, so none is replayed; retries with this key are held (409 outcome-unknown) until an operator resolves the key through the admin API.".into(),
            ProxyError::BodyTooLarge { .. } => "Protected requests are buffered to fingerprint them; send a smaller body or raise server.max_body_bytes.".into(),
            ProxyError::BadRequest(_) => "Fix the request; nothing was forwarded or claimed.".into(),
            ProxyError::NoRoute(_) => "Use a path under a configured route prefix, or send the request through the proxy with an absolute URL.".into(),
            ProxyError::KeyReused => "Nothing was forwarded. Use a new key for a new operation; a retry must repeat the first request exactly.".into(),
            ProxyError::InFlight { retry_after } => format!(
                "Nothing was forwarded. Retry in about {}s to receive the first request's response.",
                retry_after.as_secs().max(1)
            ),
            ProxyError::OutcomeUnknown { retry_after: Some(d) } => format!(
                "The first request may have taken effect at the provider, so it is not sent again. Check the provider; an operator can resolve the key through the admin API, otherwise retries execute again in {}s.",
                d.as_secs().max(1)
            ),
            ProxyError::OutcomeUnknown { retry_after: None } => "The first request may have taken effect at the provider, so it is not sent again. Check the provider and resolve the key through the admin API (commit the real receipt, or release it to let the retry execute).".into(),
            ProxyError::StoreUnavailable(_) => "Nothing was forwarded. Retry shortly with the same key.".into(),
            ProxyError::Upstream { claim, error } => match claim {
                ClaimAfterFailure::None => "Retry later.".into(),
                ClaimAfterFailure::Released if error.may_have_been_sent() => "The provider deduplicates on the key passed down, so retry with the same key.".into(),
                ClaimAfterFailure::Released => "Nothing reached the provider. Retry with the same key.".into(),
                ClaimAfterFailure::Unknown => "The request may have taken effect at the provider; retries with this key are held (409 outcome-unknown) until the hold period ends or an operator resolves it.".into(),
                ClaimAfterFailure::Unsettled => "The proxy could not record the outcome: the store did not answer (it keeps trying in the background) or another request took the claim over after its lease lapsed. Retries with this key get 409 until the claim settles or lapses into an unknown outcome.".into(),
            },
            ProxyError::Connect(e) => e.advice(),
            ProxyError::EgressRefused(_) => "Nothing was sent. An operator can allow the destination in [egress] allow, or add a route for it.".into(),
        }
    }

    fn retry_after(&self) -> Option<Duration> {
        match self {
            ProxyError::InFlight { retry_after } => Some(*retry_after),
            ProxyError::OutcomeUnknown { retry_after } => *retry_after,
            ProxyError::StoreUnavailable(_) => Some(Duration::from_secs(1)),
            _ => None,
        }
    }

    pub fn into_response(self) -> Response<Body> {
        let status = self.status();
        let slug = self.slug();
        let body = serde_json::json!({
            "type": format!("urn:idemproxy:problem:{slug}"),
            "title": self.title(),
            "status": status.as_u16(),
            "detail": format!("{self}. {}", self.advice()),
        });
        let mut resp = Response::new(full(body.to_string()));
        *resp.status_mut() = status;
        let h = resp.headers_mut();
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        h.insert("x-idemproxy-error", HeaderValue::from_static(slug));
        if let Some(d) = self.retry_after() {
            // Whole seconds, rounded up, never 0: a client retrying at once would only hit it again.
            let secs = d.as_millis().div_ceil(1000).max(1);
            if let Ok(v) = HeaderValue::from_str(&secs.to_string()) {
                h.insert(header::RETRY_AFTER, v);
            }
        }
        resp
    }
}
