//! Every refusal the proxy answers itself on a route, declared once — its status, its slug
//! (the problem type's last segment, and the code in a provider's error shape) and its title —
//! whichever part raises it (`ProxyError`, `SpendError`, `ConnectError`). The advice, which reads the error's
//! own fields, stays with each error.

use http::StatusCode;

/// One kind of refusal.
#[derive(Debug, PartialEq, Eq)]
pub struct Kind {
    pub status: StatusCode,
    pub slug: &'static str,
    pub title: &'static str,
}

macro_rules! kinds {
    ($($name:ident = $status:ident, $slug:literal, $title:literal;)*) => {
        $(pub const $name: Kind = Kind {
            status: StatusCode::$status,
            slug: $slug,
            title: $title,
        };)*
        /// Every kind, for the table's own checks.
        pub const ALL: &[&Kind] = &[$(&$name),*];
    };
}

kinds! {
    INVALID_KEY = BAD_REQUEST, "invalid-idempotency-key", "Invalid idempotency key";
    MISSING_KEY = BAD_REQUEST, "missing-idempotency-key", "Idempotency key required";
    MALFORMED_BODY = BAD_REQUEST, "malformed-body", "Malformed request body";
    UNKNOWN_ACCOUNT = BAD_REQUEST, "unknown-account", "Account not identified";
    AMBIGUOUS = BAD_REQUEST, "ambiguous-request", "Ambiguous request";
    METHOD_CASE = BAD_REQUEST, "method-case", "Method in the wrong case";
    SIGNED = BAD_REQUEST, "signed-request", "Signed request cannot be protected as sent";
    BAD_REQUEST = BAD_REQUEST, "bad-request", "Bad request";
    BUSY = SERVICE_UNAVAILABLE, "proxy-busy", "Proxy busy";
    BODY_TOO_LARGE = PAYLOAD_TOO_LARGE, "body-too-large", "Request body too large";
    NO_ROUTE = NOT_FOUND, "no-route", "No route";
    KEY_REUSED = UNPROCESSABLE_ENTITY, "idempotency-key-reused", "Idempotency key reused with a different request";
    IN_FLIGHT = CONFLICT, "request-in-flight", "Request in flight";
    OUTCOME_UNKNOWN = CONFLICT, "outcome-unknown", "Outcome unknown";
    DUPLICATE_REJECTED = CONFLICT, "outcome-unknown", "Outcome unknown: the provider already has this operation";
    STORE_UNAVAILABLE = SERVICE_UNAVAILABLE, "store-unavailable", "Idempotency store unavailable";
    UPSTREAM_TLS = BAD_GATEWAY, "upstream-tls-failed", "Upstream TLS handshake failed";
    UPSTREAM_UNREACHABLE = BAD_GATEWAY, "upstream-unreachable", "Upstream unreachable";
    UPSTREAM_TIMEOUT = GATEWAY_TIMEOUT, "upstream-timeout", "Upstream timed out";
    UPSTREAM_TOO_LARGE = BAD_GATEWAY, "upstream-response-too-large", "Upstream failed";
    UPSTREAM_FAILED = BAD_GATEWAY, "upstream-failed", "Upstream failed";
    EGRESS_REFUSED = FORBIDDEN, "egress-refused", "Destination not allowed";
    FOREIGN_ORIGIN = FORBIDDEN, "foreign-origin", "Host or Origin not allowed";
    AMOUNT_INVALID = BAD_REQUEST, "amount-invalid", "Amount cannot be read";
    RUN_INVALID = BAD_REQUEST, "run-invalid", "Invalid run id";
    KEY_REQUIRED = BAD_REQUEST, "idempotency-key-required", "A payment needs a business key";
    PAYMENT_UNREADABLE = BAD_REQUEST, "payment-unreadable", "Payment cannot be read";
    PAYMENT_REFUSED = FORBIDDEN, "payment-refused", "Payment not allowed";
    PAYMENT_NOT_PRICED = FORBIDDEN, "payment-not-priced", "Payment on a request no route prices";
    UNPRICED = FORBIDDEN, "unpriced-operation", "Operation the route cannot price";
    TOO_LARGE_TO_APPROVE = FORBIDDEN, "approval-too-large", "Too large for a person to approve";
    PENDING_LIMIT = TOO_MANY_REQUESTS, "approvals-pending-limit", "Too many approvals pending";
    FROZEN = FORBIDDEN, "spend-frozen", "Payments frozen by an operator";
    OVER_CAP = FORBIDDEN, "spend-cap-exceeded", "Spend cap exceeded";
    APPROVAL_PENDING = CONFLICT, "approval-pending", "Waiting for a person's approval";
    APPROVAL_DENIED = FORBIDDEN, "approval-denied", "A person denied this payment";
    APPROVAL_MISMATCH = CONFLICT, "approval-mismatch", "Not what the person approved";
    BAD_CONNECT_TARGET = BAD_REQUEST, "bad-connect-target", "Bad CONNECT target";
    CONNECT_PORT = FORBIDDEN, "connect-port-forbidden", "CONNECT port not allowed";
    CONNECT_HOST = FORBIDDEN, "connect-host-forbidden", "CONNECT host not allowed";
    CONNECT_ADDRESS = FORBIDDEN, "connect-address-forbidden", "CONNECT to an address not allowed";
    CONNECT_ROUTED_ADDRESS = FORBIDDEN, "connect-routed-address", "CONNECT to a routed provider's address";
    CONNECT_SIDE_DOOR = FORBIDDEN, "connect-provider-side-door", "CONNECT to a provider's side door";
    NO_CA = FORBIDDEN, "interception-not-configured", "HTTPS interception not configured";
    TUNNEL_UNREACHABLE = BAD_GATEWAY, "tunnel-target-unreachable", "Tunnel target unreachable";
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A client reads a slug as one thing: wherever two kinds share one, they share its status.
    #[test]
    fn a_slug_means_one_status() {
        for a in ALL {
            for b in ALL {
                if a.slug == b.slug {
                    assert_eq!(a.status, b.status, "{}", a.slug);
                }
            }
            assert!(a.slug.bytes().all(|c| c.is_ascii_lowercase() || c == b'-'));
        }
    }
}
