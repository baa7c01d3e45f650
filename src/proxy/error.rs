//! Why the proxy answers a request itself: one error enum, mapped to status, slug, title and
//! advice, rendered by the one problem+json renderer (`http::problem`).

use std::time::Duration;

use http::{Response, StatusCode};

use super::upstream::UpstreamError;
use crate::http::body::Body;
use crate::http::problem::Problem;
use crate::idempotency::claims::Recorded;
use crate::idempotency::outcome::Outcome;
use crate::idempotency::store::StoreError;
use crate::identity::IdentityError;

/// A failed upstream handshake is a set-up problem: retrying alone does not help.
const TLS_RETRY: &str =
    "Nothing reached the provider, and a retry fails the same way until this is fixed.";

#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    #[error(transparent)]
    Identity(#[from] IdentityError),
    #[error("{0}")]
    MalformedBody(String),
    #[error("the method `{given}` differs from the protected method {protected} only in case")]
    MethodCase { given: String, protected: String },
    /// The request cannot be protected without changing what its signature covers.
    #[error("{0}")]
    Signed(String),
    #[error("the proxy is forwarding as many protected requests as {limit} allows")]
    Busy { limit: &'static str },
    /// The provider answered "this key was already used" instead of replaying: the operation
    /// exists, but its response is not known here.
    #[error("{note}")]
    DuplicateRejected { note: String },
    #[error("the request body is larger than {limit} bytes")]
    BodyTooLarge { limit: usize },
    #[error("{0}")]
    BadRequest(String),
    /// The proxy and the provider could read the request two ways (`request::ambiguity`,
    /// `request::path`): refused, never guessed.
    #[error("{0}")]
    Ambiguous(String),
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
    /// `claim`: what became of the claim (`None`: the request was not protected).
    #[error("{error}")]
    Upstream {
        error: UpstreamError,
        claim: Option<(Outcome, Recorded)>,
    },
    #[error("egress refused: {0}")]
    EgressRefused(String),
    /// A money-moving request stopped by its caps or approvals, rendered in the provider's
    /// error shape.
    #[error("{error}")]
    Spend {
        error: super::spending::SpendError,
        shape: crate::providers::ErrorShape,
    },
}

impl ProxyError {
    fn status(&self) -> StatusCode {
        match self {
            ProxyError::Identity(_)
            | ProxyError::MalformedBody(_)
            | ProxyError::MethodCase { .. }
            | ProxyError::Signed(_)
            | ProxyError::BadRequest(_)
            | ProxyError::Ambiguous(_) => StatusCode::BAD_REQUEST,
            ProxyError::Busy { .. } => StatusCode::SERVICE_UNAVAILABLE,
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
            ProxyError::EgressRefused(_) => StatusCode::FORBIDDEN,
            ProxyError::Spend { error, .. } => error.status(),
        }
    }

    /// Stable machine-readable name; also the last segment of the problem `type`.
    pub fn slug(&self) -> &'static str {
        match self {
            ProxyError::Identity(IdentityError::InvalidKey(_)) => "invalid-idempotency-key",
            ProxyError::Identity(
                IdentityError::MissingKey { .. } | IdentityError::MissingKeyField { .. },
            ) => "missing-idempotency-key",
            ProxyError::Identity(IdentityError::Malformed(_)) | ProxyError::MalformedBody(_) => {
                "malformed-body"
            }
            ProxyError::Identity(IdentityError::Account(_)) => "unknown-account",
            ProxyError::Identity(IdentityError::Ambiguous(_)) | ProxyError::Ambiguous(_) => {
                "ambiguous-request"
            }
            ProxyError::MethodCase { .. } => "method-case",
            ProxyError::Signed(_) => "signed-request",
            ProxyError::Busy { .. } => "proxy-busy",
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
            ProxyError::EgressRefused(_) => "egress-refused",
            ProxyError::Spend { error, .. } => error.slug(),
        }
    }

    fn title(&self) -> &'static str {
        match self {
            ProxyError::Identity(IdentityError::InvalidKey(_)) => "Invalid idempotency key",
            ProxyError::Identity(
                IdentityError::MissingKey { .. } | IdentityError::MissingKeyField { .. },
            ) => "Idempotency key required",
            ProxyError::Identity(IdentityError::Malformed(_)) | ProxyError::MalformedBody(_) => {
                "Malformed request body"
            }
            ProxyError::Identity(IdentityError::Account(_)) => "Account not identified",
            ProxyError::Identity(IdentityError::Ambiguous(_)) | ProxyError::Ambiguous(_) => {
                "Ambiguous request"
            }
            ProxyError::MethodCase { .. } => "Method in the wrong case",
            ProxyError::Signed(_) => "Signed request cannot be protected as sent",
            ProxyError::Busy { .. } => "Proxy busy",
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
            } => "Upstream TLS handshake failed",
            ProxyError::Upstream {
                error: UpstreamError::Connect(_),
                ..
            } => "Upstream unreachable",
            ProxyError::Upstream {
                error: UpstreamError::Timeout(_),
                ..
            } => "Upstream timed out",
            ProxyError::Upstream { .. } => "Upstream failed",
            ProxyError::EgressRefused(_) => "Destination not allowed",
            ProxyError::Spend { .. } => "Payment stopped by spend control",
        }
    }

    fn advice(&self) -> String {
        match self {
            ProxyError::Identity(IdentityError::InvalidKey(_)) => "Send a key of 1 to 255 visible ASCII characters, e.g. a UUID.".into(),
            ProxyError::Identity(IdentityError::MissingKey { .. }) => "Add the header with a key that stays the same across retries of this operation.".into(),
            ProxyError::Identity(IdentityError::MissingKeyField { header, .. }) => format!("Nothing was forwarded or claimed. Add the field, or send a {header} header that stays the same across retries of this operation."),
            ProxyError::Identity(IdentityError::Malformed(_)) | ProxyError::MalformedBody(_) => "Nothing was forwarded or claimed. Send a well-formed body.".into(),
            ProxyError::Identity(IdentityError::Account(_)) => "Nothing was forwarded or claimed. The route tells accounts apart by its `account` template; send what it names.".into(),
            ProxyError::Identity(IdentityError::Ambiguous(_)) | ProxyError::Ambiguous(_) => "Nothing was forwarded or claimed: the proxy and the provider could read this request two ways, and a spend cap or an operation's key could be walked around. Send it in its plain form.".into(),
            ProxyError::MethodCase { protected, .. } => format!("Nothing was forwarded or claimed. HTTP methods are case-sensitive: send {protected}."),
            ProxyError::Signed(_) => "Nothing was forwarded or claimed.".into(),
            ProxyError::Busy { .. } => "Nothing was forwarded or claimed. Retry shortly with the same key.".into(),
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
                None if matches!(error, UpstreamError::Tls(_)) => TLS_RETRY.into(),
                None => "Retry later.".into(),
                Some((_, Recorded::NotOurs | Recorded::Unconfirmed)) => "The proxy could not record the outcome: the store did not answer (it keeps trying in the background) or another request took the claim over after its lease lapsed. Retries with this key get 409 until the claim settles or lapses into an unknown outcome.".into(),
                Some((Outcome::Unknown(_) | Outcome::Duplicate(_), _)) => "The request may have taken effect at the provider; retries with this key are held (409 outcome-unknown) until the hold period ends or an operator resolves it.".into(),
                Some(_) if error.may_have_been_sent() => "The provider deduplicates on the key passed down, so retry with the same key.".into(),
                Some(_) if matches!(error, UpstreamError::Tls(_)) => TLS_RETRY.into(),
                Some(_) => "Nothing reached the provider. Retry with the same key.".into(),
            },
            ProxyError::EgressRefused(_) => "Nothing was sent. An operator can allow the destination in [egress] allow, or add a route for it.".into(),
            ProxyError::Spend { error, .. } => error.advice().into(),
        }
    }

    fn retry_after(&self) -> Option<Duration> {
        match self {
            ProxyError::InFlight { retry_after } => Some(*retry_after),
            ProxyError::OutcomeUnknown { retry_after } => *retry_after,
            ProxyError::StoreUnavailable(_) | ProxyError::Busy { .. } => {
                Some(Duration::from_secs(1))
            }
            _ => None,
        }
    }

    pub fn into_response(self) -> Response<Body> {
        if let ProxyError::Spend { error, shape } = self {
            return error.into_response(shape);
        }
        Problem {
            status: self.status(),
            slug: self.slug(),
            title: self.title(),
            detail: format!("{self}. {}", self.advice()),
            retry_after: self.retry_after(),
        }
        .into_response()
    }
}
