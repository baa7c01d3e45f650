//! Console sessions as the store keeps them: a login writes its session to the store, every
//! console request reads it back (one read, no cache: a logout or an operator ending a
//! session is refused on every proxy sharing the store from the next request on), a logout
//! deletes it. Operators list the open sessions and end any one (the JSON API here, the
//! console's Sessions page).

use http::{Method, Request, Response, StatusCode};
use hyper::body::Incoming;
use serde::Deserialize;

use super::access::{Principal, Role};
use super::session::Session;
use super::{audit, json, problem, Admin};
use crate::http::body::{read_limited, Body};
use crate::http::problem::Problem;
use crate::idempotency::store::StoreError;
use crate::spend::port::OperatorSession;

const MAX_REQUEST: usize = 4 * 1024;

/// Starts a session for `who`: kept in the store first, so a cookie is never handed out for
/// a session another proxy would refuse. The `Set-Cookie` value.
pub(super) async fn open(admin: &Admin, who: &Principal, now: u64) -> Result<String, StoreError> {
    let (cookie, record) = admin.sessions.start(who, now);
    admin.app.spend.store().open_session(&record, now).await?;
    Ok(cookie)
}

/// `session` if the store still keeps it (not logged out, not ended, not expired) for the
/// token it names; `None` otherwise.
pub(super) async fn live(
    admin: &Admin,
    session: Session,
    now: u64,
) -> Result<Option<Session>, StoreError> {
    let kept = admin
        .app
        .spend
        .store()
        .operator_session(&session.id)
        .await?;
    Ok(kept
        .filter(|k| k.expires_ms > now && k.name == session.who.name)
        .map(|_| session))
}

/// The sessions open now, oldest first.
pub(super) async fn open_now(admin: &Admin, now: u64) -> Result<Vec<OperatorSession>, StoreError> {
    let all = admin.app.spend.store().operator_sessions().await?;
    Ok(all.into_iter().filter(|k| k.expires_ms > now).collect())
}

/// Ends session `id` on every proxy (as `who`, through `via`), into the audit trail.
pub(super) async fn end(
    admin: &Admin,
    who: &Principal,
    via: &'static str,
    id: &str,
) -> Result<(), Problem> {
    let store = admin.app.spend.store();
    let unavailable = |e: StoreError| {
        Problem::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "store-unavailable",
            format!("{e}. The session was not ended; try again."),
        )
    };
    let kept = store.operator_session(id).await.map_err(unavailable)?;
    let ended = store.end_session(id).await.map_err(unavailable)?;
    let Some(kept) = kept.filter(|_| ended) else {
        return Err(Problem::new(
            StatusCode::NOT_FOUND,
            "session-not-found",
            format!("id: no open console session {id} (ended already, or never opened)"),
        ));
    };
    let now = admin.app.claims.clock().now_ms();
    admin
        .audit
        .record(&audit::about_session(who, via, now, &kept));
    Ok(())
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct EndBody {
    id: String,
}

/// `GET /v1/sessions`, `POST /v1/sessions/end` (`{"id"}`): operators only.
pub(super) async fn handle(
    admin: &Admin,
    who: &Principal,
    req: Request<Incoming>,
) -> Response<Body> {
    let (method, path) = (req.method().clone(), req.uri().path().to_string());
    let ending = match (method, path.as_str()) {
        (Method::GET, "/v1/sessions") => false,
        (Method::POST, "/v1/sessions/end") => true,
        _ => {
            return problem(
                StatusCode::NOT_FOUND,
                "not-found",
                "Sessions API: GET /v1/sessions, POST /v1/sessions/end.",
            )
        }
    };
    if let Err(resp) = super::require(who, Role::Operator) {
        return *resp;
    }
    let now = admin.app.claims.clock().now_ms();
    if !ending {
        return match open_now(admin, now).await {
            Ok(all) => json(
                StatusCode::OK,
                &serde_json::json!({"sessions": all.iter().map(view).collect::<Vec<_>>()}),
            ),
            Err(e) => problem(
                StatusCode::SERVICE_UNAVAILABLE,
                "store-unavailable",
                &format!("{e}; try again."),
            ),
        };
    }
    let body: EndBody = match read_limited(req.into_body(), MAX_REQUEST).await {
        Ok(bytes) => match serde_json::from_slice(&bytes) {
            Ok(b) => b,
            Err(e) => {
                return problem(
                    StatusCode::BAD_REQUEST,
                    "bad-request",
                    &format!("the request body is not valid: {e} (send {{\"id\"}})"),
                )
            }
        },
        Err(e) => {
            return problem(
                StatusCode::BAD_REQUEST,
                "bad-request",
                &format!("cannot read the request body: {e}"),
            )
        }
    };
    match end(admin, who, "api", body.id.trim()).await {
        Ok(()) => json(
            StatusCode::OK,
            &serde_json::json!({"ended": true, "id": body.id.trim()}),
        ),
        Err(p) => p.into_response(),
    }
}

/// What an operator sees of a session: whose, since and until when. The id is no
/// credential (a cookie also needs the session key's signature); it names the session to end.
pub(super) fn view(k: &OperatorSession) -> serde_json::Value {
    serde_json::json!({
        "id": k.id,
        "principal": k.name,
        "role": k.role,
        "started_ms": k.started_ms,
        "expires_ms": k.expires_ms,
    })
}
