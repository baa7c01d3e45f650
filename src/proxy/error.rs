//! Why the proxy answers a request itself: one error enum, mapped to status, slug, title and
//! advice, and the one renderer of every such answer: `application/problem+json`
//! (`http::problem`), or, on a route whose provider has an error shape of its own, that shape,
//! so the provider's SDK raises a typed error carrying the refusal's code instead of failing
//! to parse the body.

use std::time::Duration;

use http::{HeaderValue, Response, StatusCode};

use super::refusals::{self, Kind};
use super::spend_error::SpendError;
use crate::http::body::{Body, ReadError};
use crate::http::problem::Problem;
use crate::idempotency::claims::Recorded;
use crate::idempotency::outcome::Outcome;
use crate::idempotency::store::StoreError;
use crate::identity::IdentityError;
use crate::outbound::upstream::UpstreamError;
use crate::providers::ErrorShape;
use crate::spend::gate::Refusal;

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
    /// An MCP route's DNS rebinding protection: a `Host` or `Origin` it does not answer to.
    #[error("{0}")]
    ForeignOrigin(String),
    /// A money-moving request stopped by its caps or approvals.
    #[error(transparent)]
    Spend(SpendError),
    /// A capped MCP tool call stopped by its caps or approvals: said of the call.
    #[error("{}", error.to_tool(tool).map(|(said, _)| said).unwrap_or_else(|| error.to_string()))]
    ToolSpend { tool: String, error: SpendError },
}

impl From<ReadError> for ProxyError {
    /// A request body that could not be read whole.
    fn from(e: ReadError) -> ProxyError {
        match e {
            ReadError::TooLarge(limit) => ProxyError::BodyTooLarge { limit },
            ReadError::Failed(e) => {
                ProxyError::BadRequest(format!("the request body could not be read: {e}"))
            }
        }
    }
}

impl ProxyError {
    /// What kind of refusal this is: its status, slug and title, declared once in
    /// `refusals`.
    pub fn kind(&self) -> &'static Kind {
        match self {
            ProxyError::Identity(IdentityError::InvalidKey(_)) => &refusals::INVALID_KEY,
            ProxyError::Identity(
                IdentityError::MissingKey { .. } | IdentityError::MissingKeyField { .. },
            ) => &refusals::MISSING_KEY,
            ProxyError::Identity(IdentityError::Malformed(_)) | ProxyError::MalformedBody(_) => {
                &refusals::MALFORMED_BODY
            }
            ProxyError::Identity(IdentityError::Account(_)) => &refusals::UNKNOWN_ACCOUNT,
            ProxyError::Identity(IdentityError::Ambiguous(_)) | ProxyError::Ambiguous(_) => {
                &refusals::AMBIGUOUS
            }
            ProxyError::MethodCase { .. } => &refusals::METHOD_CASE,
            ProxyError::Signed(_) => &refusals::SIGNED,
            ProxyError::Busy { .. } => &refusals::BUSY,
            ProxyError::DuplicateRejected { .. } => &refusals::DUPLICATE_REJECTED,
            ProxyError::BodyTooLarge { .. } => &refusals::BODY_TOO_LARGE,
            ProxyError::BadRequest(_) => &refusals::BAD_REQUEST,
            ProxyError::NoRoute(_) => &refusals::NO_ROUTE,
            ProxyError::KeyReused => &refusals::KEY_REUSED,
            ProxyError::InFlight { .. } => &refusals::IN_FLIGHT,
            ProxyError::OutcomeUnknown { .. } => &refusals::OUTCOME_UNKNOWN,
            ProxyError::StoreUnavailable(_) => &refusals::STORE_UNAVAILABLE,
            ProxyError::Upstream { error, .. } => match error {
                UpstreamError::Tls(_) => &refusals::UPSTREAM_TLS,
                UpstreamError::Connect(_) => &refusals::UPSTREAM_UNREACHABLE,
                UpstreamError::Timeout(_) => &refusals::UPSTREAM_TIMEOUT,
                UpstreamError::ResponseTooLarge(_) => &refusals::UPSTREAM_TOO_LARGE,
                _ => &refusals::UPSTREAM_FAILED,
            },
            ProxyError::EgressRefused(_) => &refusals::EGRESS_REFUSED,
            ProxyError::ForeignOrigin(_) => &refusals::FOREIGN_ORIGIN,
            ProxyError::Spend(error) | ProxyError::ToolSpend { error, .. } => error.kind(),
        }
    }

    fn status(&self) -> StatusCode {
        self.kind().status
    }

    /// Stable machine-readable name; also the last segment of the problem `type`.
    pub fn slug(&self) -> &'static str {
        self.kind().slug
    }

    fn title(&self) -> &'static str {
        self.kind().title
    }

    fn advice(&self) -> String {
        match self {
            ProxyError::Identity(IdentityError::InvalidKey(_)) => "Send a key of 1 to 255 visible ASCII characters, e.g. a UUID.".into(),
            ProxyError::Identity(IdentityError::MissingKey { .. }) => "Add the header with a key that stays the same across retries of this operation.".into(),
            ProxyError::Identity(IdentityError::MissingKeyField { header: Some(header), .. }) => format!("Nothing was forwarded or claimed. Add the field, or send a {header} header that stays the same across retries of this operation."),
            ProxyError::Identity(IdentityError::MissingKeyField { header: None, .. }) => "Nothing was forwarded or claimed. Add the field: it tells this operation from another one, so a re-run of the same operation is recognised.".into(),
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
            ProxyError::ForeignOrigin(_) => "Nothing was read or forwarded: a web page may be posting to a local proxy under its own name (DNS rebinding). An operator can name the host in [routes.mcp] allowed_hosts or the origin in allowed_origins.".into(),
            ProxyError::Spend(error) => error.advice().into(),
            ProxyError::ToolSpend { tool, error } => error
                .to_tool(tool)
                .map_or(error.advice(), |(_, advice)| advice)
                .into(),
        }
    }

    fn retry_after(&self) -> Option<Duration> {
        match self {
            ProxyError::InFlight { retry_after } => Some(*retry_after),
            ProxyError::OutcomeUnknown { retry_after } => *retry_after,
            ProxyError::StoreUnavailable(_) | ProxyError::Busy { .. } => {
                Some(Duration::from_secs(1))
            }
            ProxyError::Spend(error) | ProxyError::ToolSpend { error, .. } => error.retry_after(),
            _ => None,
        }
    }

    /// Whether a client that retries by itself within a second or two (Stripe's SDKs, which
    /// obey `Stripe-Should-Retry`) should: only where that retry can get another answer and
    /// cannot do harm. A pending approval is not: each attempt would be parked again for
    /// `approval_wait`, holding the tool past its timeout; the agent asks again later.
    fn worth_retrying_soon(&self) -> bool {
        match self {
            ProxyError::InFlight { .. }
            | ProxyError::StoreUnavailable(_)
            | ProxyError::Busy { .. }
            | ProxyError::Spend(SpendError::Refused(Refusal::Store(_)))
            | ProxyError::ToolSpend {
                error: SpendError::Refused(Refusal::Store(_)),
                ..
            } => true,
            ProxyError::Upstream { error, claim } => match claim {
                _ if matches!(error, UpstreamError::Tls(_)) => false,
                None | Some((Outcome::Released, Recorded::Done)) => true,
                Some(_) => false,
            },
            _ => false,
        }
    }

    /// The answer, in the route's provider's error shape (`ErrorShape::Problem`: no provider
    /// shape, or no route).
    pub fn into_response(self, shape: ErrorShape) -> Response<Body> {
        self.answer(shape, None)
    }

    /// The answer to the JSON-RPC request `id` on an MCP route: a JSON-RPC error response with
    /// that id (HTTP 200, so the client raises it as the call's error).
    pub fn into_jsonrpc(self, id: &serde_json::Value) -> Response<Body> {
        self.answer(ErrorShape::JsonRpc, Some(id))
    }

    /// Whether this is a spend refusal of an MCP tool call (what `into_tool_result` answers).
    pub fn is_tool_spend(&self) -> bool {
        matches!(self, ProxyError::ToolSpend { .. })
    }

    /// The refusal of the JSON-RPC request `id` as a tool result with `isError: true` (HTTP
    /// 200), for agent frameworks that show their model only results: the message is its
    /// text content, and `_meta` carries the slug as `error.data` would.
    pub fn into_tool_result(self, id: &serde_json::Value) -> Response<Body> {
        let problem = Problem {
            status: self.status(),
            slug: self.slug(),
            title: self.title(),
            detail: format!("{self}. {}", self.advice()),
            retry_after: self.retry_after(),
        };
        let body = serde_json::json!({"jsonrpc": "2.0", "id": id,
            "result": {"content": [{"type": "text", "text": problem.detail}], "isError": true,
                "_meta": {"io.idemproxy/refusal": {"slug": problem.slug,
                    "status": problem.status.as_u16(),
                    "retryAfter": problem.retry_after.map(|d| d.as_secs().max(1))}}}});
        let mut resp = problem.json_response(body.to_string());
        *resp.status_mut() = StatusCode::OK;
        resp
    }

    fn answer(self, shape: ErrorShape, id: Option<&serde_json::Value>) -> Response<Body> {
        let retry = self.worth_retrying_soon();
        let problem = Problem {
            status: self.status(),
            slug: self.slug(),
            title: self.title(),
            detail: format!("{self}. {}", self.advice()),
            retry_after: self.retry_after(),
        };
        render(problem, shape, retry, id)
    }
}

/// The one renderer of the proxy's own answers on a route: problem+json, or the provider's
/// error body with the same status, `Retry-After` and `X-Idemproxy-Error` slug. The slug is
/// also the provider error's code (`idemproxy_<slug>`), so either can be matched on. On an MCP
/// route (`ErrorShape::JsonRpc`) it is a JSON-RPC error whose `data` carries the slug: with
/// the request's `id` it goes out as HTTP 200 (clients raise a JSON-RPC error only from a
/// response they can read); without one (an unreadable body) with the refusal's status.
pub fn render(
    problem: Problem,
    shape: ErrorShape,
    retry: bool,
    id: Option<&serde_json::Value>,
) -> Response<Body> {
    let code = format!("idemproxy_{}", problem.slug.replace('-', "_"));
    let message = problem.detail.as_str();
    let status = problem.status;
    let body = match shape {
        ErrorShape::Problem => return problem.into_response(),
        ErrorShape::JsonRpc => serde_json::json!({"jsonrpc": "2.0",
            "id": id.cloned().unwrap_or(serde_json::Value::Null),
            "error": {"code": jsonrpc_code(problem.slug), "message": message,
                "data": {"code": code, "slug": problem.slug, "status": status.as_u16(),
                    "retryAfter": problem.retry_after.map(|d| d.as_secs().max(1))}}}),
        ErrorShape::Stripe => serde_json::json!({"error": {
            "type": stripe_type(status, problem.slug), "code": code, "message": message}}),
        ErrorShape::Square => serde_json::json!({"errors": [{
            "category": "INVALID_REQUEST_ERROR", "code": code.to_uppercase(), "detail": message}]}),
        ErrorShape::Adyen => serde_json::json!({
            "status": status.as_u16(), "errorCode": code, "message": message, "errorType": "validation"}),
        ErrorShape::PayPal => serde_json::json!({
            "name": code.to_uppercase(), "message": message, "debug_id": problem.slug}),
        ErrorShape::Alpaca => {
            serde_json::json!({"code": 40_000_000 + u64::from(status.as_u16()) * 10_000, "message": message})
        }
    };
    let mut resp = problem.json_response(body.to_string());
    if shape == ErrorShape::JsonRpc && id.is_some() {
        *resp.status_mut() = StatusCode::OK;
    }
    if shape == ErrorShape::Stripe {
        // stripe-python and stripe-node obey this over their own rules (which retry every
        // 409 and 5xx).
        resp.headers_mut().insert(
            "stripe-should-retry",
            HeaderValue::from_static(if retry { "true" } else { "false" }),
        );
    }
    resp
}

/// The JSON-RPC error code: the standard ones where they fit, else the server-error range.
fn jsonrpc_code(slug: &str) -> i64 {
    match slug {
        "malformed-body" => -32700,
        "ambiguous-request" | "bad-request" | "body-too-large" => -32600,
        "invalid-idempotency-key" | "missing-idempotency-key" => -32602,
        "idempotency-key-reused" => -32022,
        "request-in-flight" => -32009,
        "outcome-unknown" => -32010,
        _ => -32000,
    }
}

/// Stripe's error `type` for a refusal: its SDKs pick the error class by it (stripe-node) or
/// by the status (stripe-python).
fn stripe_type(status: StatusCode, slug: &str) -> &'static str {
    match slug {
        "idempotency-key-reused" | "request-in-flight" => "idempotency_error",
        _ if status == StatusCode::CONFLICT || status.is_server_error() => "api_error",
        _ => "invalid_request_error",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt as _;

    async fn rendered(
        e: ProxyError,
        shape: ErrorShape,
    ) -> (http::response::Parts, serde_json::Value) {
        let (parts, body) = e.into_response(shape).into_parts();
        let bytes = body.collect().await.expect("a full body").to_bytes();
        (parts, serde_json::from_slice(&bytes).expect("JSON"))
    }

    fn header<'p>(parts: &'p http::response::Parts, name: &str) -> Option<&'p str> {
        parts.headers.get(name).and_then(|v| v.to_str().ok())
    }

    #[tokio::test]
    async fn every_refusal_takes_the_route_shape_with_its_slug_as_the_code() {
        let (parts, body) = rendered(ProxyError::KeyReused, ErrorShape::Stripe).await;
        assert_eq!(parts.status, StatusCode::UNPROCESSABLE_ENTITY);
        assert_eq!(header(&parts, "content-type"), Some("application/json"));
        assert_eq!(
            header(&parts, "x-idemproxy-error"),
            Some("idempotency-key-reused")
        );
        assert_eq!(header(&parts, "stripe-should-retry"), Some("false"));
        assert_eq!(body["error"]["code"], "idemproxy_idempotency_key_reused");
        assert_eq!(body["error"]["type"], "idempotency_error");

        let in_flight = ProxyError::InFlight {
            retry_after: Duration::from_secs(3),
        };
        let (parts, body) = rendered(in_flight, ErrorShape::Stripe).await;
        assert_eq!(header(&parts, "stripe-should-retry"), Some("true"));
        assert_eq!(header(&parts, "retry-after"), Some("3"));
        assert_eq!(body["error"]["code"], "idemproxy_request_in_flight");

        let unknown = ProxyError::OutcomeUnknown { retry_after: None };
        let (parts, body) = rendered(unknown, ErrorShape::Alpaca).await;
        assert_eq!(parts.status, StatusCode::CONFLICT);
        assert_eq!(header(&parts, "stripe-should-retry"), None);
        assert!(body["message"]
            .as_str()
            .is_some_and(|m| m.contains("unknown")));

        let (parts, body) = rendered(ProxyError::KeyReused, ErrorShape::Problem).await;
        assert_eq!(
            header(&parts, "content-type"),
            Some("application/problem+json")
        );
        assert_eq!(body["type"], "urn:idemproxy:problem:idempotency-key-reused");
    }

    #[tokio::test]
    async fn a_template_operation_missing_its_field_does_not_blame_the_header() {
        let e = ProxyError::Identity(IdentityError::MissingKeyField {
            header: None,
            field: "body.metadata.invoice_id".into(),
        });
        let (_, body) = rendered(e, ErrorShape::Stripe).await;
        let message = body["error"]["message"].as_str().unwrap_or_default();
        assert!(message.contains("body.metadata.invoice_id"), "{message}");
        assert!(!message.contains("header"), "{message}");
    }
}
