//! The key API: find a claim the way an operator knows it (route, tenant, client key and
//! optionally the credential it was sent with — or the scope a list showed), inspect it, and
//! resolve an UNKNOWN one by releasing it or committing the receipt the operator got from the
//! provider. Every resolve is fenced on the token the operator saw: it never touches a newer
//! claim.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use base64::Engine as _;
use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Method, Request, Response, StatusCode};
use hyper::body::Incoming;
use serde::Deserialize;

use super::access::{Principal, Role};
use super::audit;
use super::{json, problem, require, Admin};
use crate::http::body::{read_limited, Body};
use crate::http::problem::Problem;
use crate::idempotency::claims::{Resolution, Resolved, Verdict};
use crate::idempotency::record::{Receipt, Record, ResolvedBy, State};
use crate::idempotency::store::StoreError;
use crate::identity::Identity;
use crate::outbound::lookup::{Asking, Lookup};
use crate::request::Request as Read;
use crate::routes::Route;

fn default_tenant() -> String {
    crate::auth::DEFAULT_TENANT.to_string()
}

#[derive(Debug, Deserialize)]
struct Resolve {
    #[serde(flatten)]
    lookup: LookupFields,
    /// The token `show` or `list` printed: the claim the operator checked.
    token: String,
    action: Action,
    receipt: Option<OperatorReceipt>,
    /// Who resolves: needed with the shared token; a named token resolves as its name.
    by: Option<String>,
    /// Why (recorded in the audit trail and with the receipt).
    reason: Option<String>,
    /// The provider's id of what the operation made (`ch_…`), if known.
    object: Option<String>,
}

/// How an operator names a claim: the scope a list showed, or route + tenant + client key
/// and the credential headers the client sent (e.g. `{"authorization": "Bearer sk_…"}`),
/// hashed exactly as the proxy does, never stored or logged.
#[derive(Debug, Deserialize)]
struct LookupFields {
    scope: Option<String>,
    route: Option<String>,
    #[serde(default = "default_tenant")]
    tenant: String,
    key: Option<String>,
    #[serde(default)]
    credentials: BTreeMap<String, String>,
}

/// Ask the provider about a held claim, with credentials the operator gives.
#[derive(Debug, Deserialize)]
struct Reconcile {
    #[serde(flatten)]
    lookup: LookupFields,
    token: String,
    /// The key the held attempt passed down, when it is not the client key (`key`).
    passed_down: Option<String>,
}

#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(rename_all = "lowercase")]
enum Action {
    Release,
    Commit,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct OperatorReceipt {
    status: u16,
    #[serde(default)]
    headers: Vec<(String, String)>,
    /// UTF-8 body …
    body: Option<String>,
    /// … or any bytes, base64.
    body_base64: Option<String>,
}

const MAX_REQUEST: usize = 1 << 20;

pub(super) async fn handle(
    admin: &Admin,
    who: &Principal,
    req: Request<Incoming>,
) -> Response<Body> {
    let method = req.method().clone();
    let path = req.uri().path().to_string();
    let query = req.uri().query().unwrap_or("").to_string();
    if matches!(path.as_str(), "/v1/keys/resolve" | "/v1/keys/reconcile") {
        if let Err(resp) = require(who, Role::Operator) {
            return *resp;
        }
    }
    match (method, path.as_str()) {
        (Method::GET, "/v1/keys") => list(admin, &query).await,
        (Method::POST, "/v1/keys/show") => match body::<LookupFields>(req).await {
            Ok(l) => show(admin, l).await,
            Err(resp) => resp,
        },
        (Method::POST, "/v1/keys/resolve") => match body::<Resolve>(req).await {
            Ok(r) => resolve(admin, who, r).await,
            Err(resp) => resp,
        },
        (Method::POST, "/v1/keys/reconcile") => match body::<Reconcile>(req).await {
            Ok(r) => reconcile(admin, who, r).await,
            Err(resp) => resp,
        },
        _ => problem(
            StatusCode::NOT_FOUND,
            "not-found",
            "Key API: GET /v1/keys?state=unknown, POST /v1/keys/show, POST /v1/keys/resolve, POST /v1/keys/reconcile.",
        ),
    }
}

async fn body<T: serde::de::DeserializeOwned>(req: Request<Incoming>) -> Result<T, Response<Body>> {
    let bytes = read_limited(req.into_body(), MAX_REQUEST)
        .await
        .map_err(|e| bad(&format!("cannot read the request body: {e}")))?;
    serde_json::from_slice(&bytes).map_err(|e| bad(&format!("the request body is not valid: {e}")))
}

fn bad(detail: &str) -> Response<Body> {
    problem(StatusCode::BAD_REQUEST, "bad-request", detail)
}

fn refuse(detail: &str) -> Box<Response<Body>> {
    Box::new(bad(detail))
}

fn store_error(e: StoreError) -> Response<Body> {
    problem(
        StatusCode::SERVICE_UNAVAILABLE,
        "store-unavailable",
        &format!("{e}. Nothing was changed; try again."),
    )
}

async fn list(admin: &Admin, query: &str) -> Response<Body> {
    let mut state = State::Unknown;
    let mut limit = admin.list_limit;
    for (k, v) in query.split('&').filter_map(|kv| kv.split_once('=')) {
        match k {
            "state" => {
                state = match v.to_ascii_lowercase().as_str() {
                    "unknown" => State::Unknown,
                    "pending" => State::Pending,
                    "committed" => State::Committed,
                    _ => return bad("state must be unknown, pending or committed"),
                }
            }
            "limit" => match v.parse::<usize>() {
                Ok(n) if n > 0 => limit = n.min(admin.list_limit),
                _ => return bad("limit must be a positive number"),
            },
            _ => {}
        }
    }
    let found = match admin.app.claims.store().list(state, limit).await {
        Ok(found) => found,
        Err(e) => return store_error(e),
    };
    let keys: Vec<_> = found.iter().map(|(s, r)| view(s, r)).collect();
    json(
        StatusCode::OK,
        &serde_json::json!({"state": state.as_str(), "count": keys.len(), "keys": keys}),
    )
}

async fn show(admin: &Admin, lookup: LookupFields) -> Response<Body> {
    let scope = match scope_of(admin, lookup) {
        Ok(s) => s,
        Err(resp) => return *resp,
    };
    match (admin.app.claims.store().get(&scope)).await {
        Ok(Some(record)) => json(StatusCode::OK, &view(&scope, &record)),
        Ok(None) => not_found(&scope),
        Err(e) => store_error(e),
    }
}

fn not_found(scope: &str) -> Response<Body> {
    not_found_problem(scope).into_response()
}

fn not_found_problem(scope: &str) -> Problem {
    Problem::new(
        StatusCode::NOT_FOUND,
        "key-not-found",
        format!("No claim under {scope}: never claimed, released, or expired. Check route, tenant, key and the credential headers the client sent."),
    )
}

async fn resolve(admin: &Admin, who: &Principal, r: Resolve) -> Response<Body> {
    let scope = match scope_of(admin, r.lookup) {
        Ok(s) => s,
        Err(resp) => return *resp,
    };
    let decision = match r.action {
        Action::Release => Held::Release,
        Action::Commit => match r.receipt.map(operator_receipt) {
            Some(Ok(receipt)) => Held::Attest(receipt),
            Some(Err(detail)) => return bad(&detail),
            None => {
                return bad("action commit needs a receipt: {status, headers, body | body_base64}")
            }
        },
    };
    let by = match (r.by.as_deref().map(str::trim), who.shared) {
        (Some(by), true) if !by.is_empty() => by.to_string(),
        (_, true) => "an operator".to_string(),
        (_, false) => who.name.clone(),
    };
    let held = HeldDecision {
        decision,
        why: r.reason,
        object: r.object,
    };
    match resolve_held(admin, who, &by, "api", &scope, &r.token, held).await {
        Ok(action) => json(
            StatusCode::OK,
            &serde_json::json!({"scope": scope, "resolved": action}),
        ),
        Err(p) => p.into_response(),
    }
}

/// What a person decided about a held (UNKNOWN) outcome.
pub(super) enum Held {
    /// It did not happen: the next retry executes.
    Release,
    /// It happened, and this is its response as the operator has it (operator-attested).
    Attest(Receipt),
}

pub(super) struct HeldDecision {
    pub decision: Held,
    pub why: Option<String>,
    /// The provider's id of what the operation made.
    pub object: Option<String>,
}

/// The header every replay of an operator-attested receipt carries.
pub const ATTESTED_HEADER: &str = "idempotent-receipt-source";

/// Resolves the UNKNOWN claim under `scope`, if it still is the one with `token` (the console
/// and the API both resolve here). An attested receipt is marked on every replay with who
/// attested it; the decision goes to the audit trail.
pub(super) async fn resolve_held(
    admin: &Admin,
    who: &Principal,
    by: &str,
    via: &'static str,
    scope: &str,
    token: &str,
    held: HeldDecision,
) -> Result<&'static str, Problem> {
    let object = object_id(held.object.as_deref())?;
    let why = held
        .why
        .map(|w| w.trim().to_string())
        .filter(|w| !w.is_empty());
    let now = admin.app.claims.clock().now_ms();
    let (how, action) = match held.decision {
        Held::Release => (Resolution::Release, "released"),
        Held::Attest(mut receipt) => {
            receipt.headers.retain(|(k, _)| k != ATTESTED_HEADER);
            receipt.headers.push((
                ATTESTED_HEADER.into(),
                attested_value(by, now, object.as_deref()),
            ));
            (Resolution::Commit(receipt), "committed")
        }
    };
    let record = admin.app.claims.store().get(scope).await.ok().flatten();
    let resolved_by = ResolvedBy {
        by: by.to_string(),
        at_ms: now,
        how: if action == "released" {
            "released".into()
        } else {
            "attested".into()
        },
        why: why.clone(),
        object: object.clone(),
    };
    let resolved_by_copy = resolved_by.clone();
    let retention = |route: &str| retention_of(admin, route);
    match admin
        .app
        .claims
        .resolve(scope, token, how, resolved_by, retention)
        .await
    {
        Ok(Resolved::Done { route }) => {
            admin.held.clear();
            if action == "released" {
                release_spend(admin, token).await;
            }
            admin.app.metrics.unknown_resolved(&route, "operator");
            tracing::info!(scope, action, by, "operator resolved an UNKNOWN claim");
            let fingerprint = record.map(|r| r.body.fingerprint).unwrap_or_default();
            admin.audit.record(&audit::about_claim(
                who,
                via,
                scope,
                &route,
                fingerprint,
                &resolved_by_copy,
            ));
            Ok(action)
        }
        Ok(Resolved::Changed(now)) => Err(changed_problem(scope, &now)),
        Ok(Resolved::Gone) => Err(not_found_problem(scope)),
        Err(e) => Err(Problem::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "store-unavailable",
            format!("{e}. Nothing was changed; try again."),
        )),
    }
}

/// A provider object id as an operator typed it: `None` when blank.
fn object_id(given: Option<&str>) -> Result<Option<String>, Problem> {
    match given.map(str::trim).filter(|o| !o.is_empty()) {
        None => Ok(None),
        Some(o)
            if o.len() <= 255
                && o.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"_-.:".contains(&b)) =>
        {
            Ok(Some(o.to_string()))
        }
        Some(_) => Err(Problem::new(
            StatusCode::BAD_REQUEST,
            "bad-request",
            "object: a provider object id is 1-255 letters, digits, `_`, `-`, `.` or `:`",
        )),
    }
}

/// `operator-attested; by="ana"; at=1733…; object="ch_1"`: what a replay of an attested
/// receipt says about it. Quotes and control bytes in the name are dropped.
fn attested_value(by: &str, at_ms: u64, object: Option<&str>) -> String {
    let by: String = by
        .chars()
        .filter(|c| c.is_ascii_graphic() && *c != '"' && *c != '\\' || *c == ' ')
        .take(128)
        .collect();
    let mut v = format!("operator-attested; by=\"{by}\"; at={at_ms}");
    if let Some(o) = object {
        v.push_str(&format!("; object=\"{o}\""));
    }
    v
}

/// Asks the provider about a held claim, with the credentials the operator gave (the
/// route's lookup, as a retry would), and applies the verdict: found → committed (marked
/// reconciled), not found → released (the next retry executes), unclear → nothing changes.
async fn reconcile(admin: &Admin, who: &Principal, r: Reconcile) -> Response<Body> {
    // The scope is computed from the credentials given, so the lookup runs as the account
    // that made the request. A scope alone cannot show whose credentials these are: another
    // account's "not found" would release an operation that happened.
    if r.lookup.scope.is_some() {
        return bad("name the claim by route, key and the credentials the client sent (not by scope): the lookup must run as the account that made the request. For a derived operation, look it up at the provider and use keys resolve");
    }
    let client_key = r.lookup.key.clone();
    let (tenant, credentials) = (r.lookup.tenant.clone(), r.lookup.credentials.clone());
    let scope = match scope_of(admin, r.lookup) {
        Ok(s) => s,
        Err(resp) => return *resp,
    };
    let (found, route) = match held(admin, &scope, &r.token).await {
        Ok(held) => held,
        Err(resp) => return *resp,
    };
    let Some(lookup) = &route.lookup else {
        return bad(&format!(
            "route `{}` has no lookup: check the provider and resolve the claim instead",
            route.name
        ));
    };
    // A key the operator typed is checked against the hash the held attempt kept: a typo
    // would be "not found" at the provider and release an operation that happened.
    if let Some(typed) = &r.passed_down {
        let typed_hash = crate::hex::lower(&crate::auth::sha256(typed.as_bytes()));
        match found.body.passed_down_sha256.as_deref() {
            Some(kept) if kept == typed_hash => {}
            Some(_) => {
                return bad("passed_down is not the key the held attempt passed down to the provider (the claim keeps its hash): check it, or give key (the client's key) instead")
            }
            None => {
                return bad("this claim keeps no hash of the key its attempt passed down (its holder stopped before settling), so a typed passed_down cannot be checked: give key (the client's key), or look the operation up at the provider and use keys resolve")
            }
        }
    }
    let Some(passed_down) = r.passed_down.or_else(|| {
        client_key.map(|k| {
            route
                .passing()
                .ours(&tenant, &Identity::Client(k), "", found.body.attempt)
        })
    }) else {
        return bad("give key (the client's key) or passed_down (the key the provider got)");
    };
    let verdict = ask(
        admin,
        &route,
        lookup,
        &credentials,
        &tenant,
        &passed_down,
        found.body.lookup_target.as_deref(),
    )
    .await;
    apply(admin, who, &scope, &r.token, &route, verdict).await
}

/// The UNKNOWN claim under `scope`, if it is still the one the operator saw (`token`), and
/// its route.
async fn held(
    admin: &Admin,
    scope: &str,
    token: &str,
) -> Result<(Record, Arc<Route>), Box<Response<Body>>> {
    let found = match admin.app.claims.store().get(scope).await {
        Ok(Some(found)) => found,
        Ok(None) => return Err(Box::new(not_found(scope))),
        Err(e) => return Err(Box::new(store_error(e))),
    };
    if found.token.as_str() != token || found.state != State::Unknown {
        return Err(Box::new(changed(scope, &found)));
    }
    let routes = admin.app.routes.all();
    let Some(route) = routes.into_iter().find(|x| x.name == found.body.route) else {
        return Err(refuse(&format!(
            "route `{}` is not configured any more",
            found.body.route
        )));
    };
    Ok((found, route))
}

/// The route's lookup for the attempt that passed down `passed_down`, sent with the
/// credentials the operator gave.
async fn ask(
    admin: &Admin,
    route: &Route,
    lookup: &Lookup,
    credentials: &BTreeMap<String, String>,
    tenant: &str,
    passed_down: &str,
    target: Option<&str>,
) -> Verdict {
    let mut headers = HeaderMap::new();
    for (name, value) in credentials {
        if let (Ok(n), Ok(v)) = (
            HeaderName::from_bytes(name.as_bytes()),
            HeaderValue::from_str(value),
        ) {
            headers.append(n, v);
        }
    }
    let request = Read::new(&Method::GET, "", "", &headers, b"", tenant);
    let asking = Asking {
        request: &request,
        key: passed_down,
        target,
    };
    lookup
        .ask(
            &*route.client,
            |target| route.upstream_uri(target).ok(),
            &asking,
            &[],
            route.timeout,
            admin.app.max_receipt_bytes,
        )
        .await
}

/// Resolves the claim as the verdict says, fenced on the token the operator saw; an
/// unclear verdict changes nothing.
async fn apply(
    admin: &Admin,
    who: &Principal,
    scope: &str,
    token: &str,
    route: &Route,
    verdict: Verdict,
) -> Response<Body> {
    let (how, said) = match verdict {
        Verdict::Found(receipt) => (Resolution::Reconciled(receipt), "found"),
        Verdict::NotFound => (Resolution::Release, "not found"),
        Verdict::Unclear(why) => {
            return problem(
                StatusCode::CONFLICT,
                "lookup-unclear",
                &format!("Nothing was changed: the provider could not say whether the operation happened ({why})."),
            )
        }
    };
    let retention = |route: &str| retention_of(admin, route);
    match admin
        .app
        .claims
        .resolve(
            scope,
            token,
            how,
            ResolvedBy {
                by: format!("a lookup asked by {}", who.name),
                at_ms: admin.app.claims.clock().now_ms(),
                how: "reconciled".into(),
                why: None,
                object: None,
            },
            retention,
        )
        .await
    {
        Ok(Resolved::Done { .. }) => {
            admin.held.clear();
            if said == "not found" {
                release_spend(admin, token).await;
            }
            admin.app.metrics.unknown_resolved(&route.name, "lookup");
            json(
                StatusCode::OK,
                &serde_json::json!({"scope": scope, "lookup": said, "resolved": if said == "found" { "committed" } else { "released" }}),
            )
        }
        Ok(Resolved::Changed(now)) => changed(scope, &now),
        Ok(Resolved::Gone) => not_found(scope),
        Err(e) => store_error(e),
    }
}

/// The held attempt (`token`, the claim's) did not happen: its spend reservation goes back
/// with it. A store error leaves it counted (it ages out of its window), never the reverse.
async fn release_spend(admin: &Admin, token: &str) {
    if let Err(e) = admin.app.spend.store().release(token).await {
        tracing::warn!(error = %e, "could not give back the released operation's spend reservation");
    }
}

/// How long a receipt committed for `route` is kept: the route's retention; for a route
/// that is gone (renamed), as long as any route would keep it.
fn retention_of(admin: &Admin, route: &str) -> Duration {
    let routes = admin.app.routes.all();
    routes
        .iter()
        .find(|r| r.name == route)
        .map(|r| r.policy.retention)
        .or_else(|| routes.iter().map(|r| r.policy.retention).max())
        .unwrap_or_else(crate::config::default_retention)
}

fn changed(scope: &str, now: &Record) -> Response<Body> {
    changed_problem(scope, now).into_response()
}

fn changed_problem(scope: &str, now: &Record) -> Problem {
    Problem::new(
        StatusCode::CONFLICT,
        "claim-changed",
        format!(
            "Nothing was changed: the claim under {scope} is now {} with token {}, not the UNKNOWN claim with the token you gave. Show it again and decide on what it is now.",
            now.state.as_str(),
            now.token.as_str()
        ),
    )
}

fn operator_receipt(r: OperatorReceipt) -> Result<Receipt, String> {
    if !(100..=599).contains(&r.status) {
        return Err(format!("receipt.status {} is not an HTTP status", r.status));
    }
    for (name, value) in &r.headers {
        HeaderName::from_bytes(name.as_bytes())
            .map_err(|_| format!("receipt header name `{name}` is not valid"))?;
        HeaderValue::from_str(value)
            .map_err(|_| format!("receipt header `{name}` has a value that is not valid"))?;
    }
    let body = match (r.body, r.body_base64) {
        (Some(text), None) => Bytes::from(text),
        (None, Some(b64)) => Bytes::from(
            base64::engine::general_purpose::STANDARD
                .decode(b64.trim())
                .map_err(|e| format!("receipt.body_base64 is not base64: {e}"))?,
        ),
        (None, None) => Bytes::new(),
        (Some(_), Some(_)) => {
            return Err("give receipt.body or receipt.body_base64, not both".into())
        }
    };
    Ok(Receipt {
        status: r.status,
        headers: r
            .headers
            .into_iter()
            .map(|(k, v)| (k.to_ascii_lowercase(), v))
            .collect(),
        body,
    })
}

/// The scope of client key `key` on `route` for `tenant`, sent without credentials (the
/// console's lookup; a route whose account comes from a credential needs the API's).
pub(super) fn scope_for(
    admin: &Admin,
    route: &str,
    tenant: &str,
    key: &str,
) -> Result<String, String> {
    let fields = LookupFields {
        scope: None,
        route: Some(route.to_string()),
        tenant: tenant.to_string(),
        key: Some(key.to_string()),
        credentials: BTreeMap::new(),
    };
    scope_of(admin, fields).map_err(|_| format!("No route `{route}`, or its account needs the client's credential: use `idemproxy keys show`."))
}

fn scope_of(admin: &Admin, l: LookupFields) -> Result<String, Box<Response<Body>>> {
    if let Some(scope) = l.scope {
        if l.route.is_some() || l.key.is_some() {
            return Err(refuse(
                "give either scope, or route + key (+ tenant, credentials)",
            ));
        }
        return Ok(scope);
    }
    let (Some(route_name), Some(key)) = (l.route, l.key) else {
        return Err(refuse(
            "give scope, or route and key (and tenant and credentials if the client sent them)",
        ));
    };
    let Some(route) = admin
        .app
        .routes
        .all()
        .into_iter()
        .find(|r| r.name == route_name)
    else {
        return Err(refuse(&format!("no route is named `{route_name}`")));
    };
    let mut headers = HeaderMap::new();
    for (name, value) in &l.credentials {
        let (Ok(n), Ok(v)) = (
            HeaderName::from_bytes(name.as_bytes()),
            HeaderValue::from_str(value),
        ) else {
            return Err(refuse(&format!(
                "credentials: `{name}` is not a valid header"
            )));
        };
        headers.append(n, v);
    }
    // The account as the route tells it apart, from the credentials given (for a route whose
    // account comes from the path or body, give the scope from the log line instead).
    let view = Read::new(&Method::POST, "", "", &headers, b"", &l.tenant);
    let ignore = [&route.identity.key_header];
    let account = route
        .identity
        .account
        .fingerprint(&view, &ignore, route.identity.derivations.primary)
        .map_err(|e| refuse(&format!("credentials: {e}")))?;
    let place = route.place(&admin.app.namespace, &l.tenant);
    Ok(place.scope(&account, &Identity::Client(key).scope_key("")))
}

/// A record as operators see it: no receipt body, no header values (they may carry
/// provider-set secrets such as cookies).
pub(super) fn view(scope: &str, r: &Record) -> serde_json::Value {
    let tenant = scope.split(':').nth(1).unwrap_or("");
    serde_json::json!({
        "scope": scope,
        "tenant": tenant,
        "state": r.state.as_str(),
        "token": r.token.as_str(),
        "route": r.body.route,
        "fingerprint": r.body.fingerprint,
        "created_ms": r.body.created_ms,
        "lease_until_ms": r.body.lease_until_ms,
        "unknown_since_ms": r.body.unknown_since_ms,
        "note": r.body.note,
        "attempt": r.body.attempt,
        "reconciled": r.body.reconciled,
        "settled_ms": r.body.settled_ms,
        "resolved": r.body.resolved,
        "receipt": r.body.receipt.as_ref().map(|rc| serde_json::json!({
            "status": rc.status,
            "header_names": rc.headers.iter().map(|(k, _)| k.clone()).collect::<Vec<_>>(),
            "body_bytes": rc.body.len(),
        })),
    })
}
