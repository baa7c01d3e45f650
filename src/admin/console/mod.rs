//! The console: the admin API's operations as server-rendered pages. Everything an agent
//! wrote is escaped by the template engine; no script runs but the one file served from the
//! binary (a strict Content-Security-Policy says so); a session cookie carries the login and
//! every form carries a CSRF token derived from it.

mod pages;
mod sessions_page;
mod views;

use std::collections::HashMap;
use std::net::IpAddr;

use askama::Template;
use http::{header, HeaderValue, Method, Request, Response, StatusCode};
use hyper::body::Incoming;

use super::access::Role;
use super::session::{csrf_matches, Session};
use super::Admin;
use crate::http::body::{full, read_limited, Body};

const CSS: &str = include_str!("assets/console.css");
const JS: &str = include_str!("assets/console.js");
const MAX_FORM: usize = 64 * 1024;

/// No inline script or style, nothing from elsewhere, never in a frame.
const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; form-action 'self'; base-uri 'none'; frame-ancestors 'none'";

pub(super) async fn handle(admin: &Admin, req: Request<Incoming>, peer: IpAddr) -> Response<Body> {
    let path = req.uri().path().to_string();
    let method = req.method().clone();
    match (&method, path.as_str()) {
        (&Method::GET, "/console/assets/console.css") => {
            return asset(CSS, "text/css; charset=utf-8")
        }
        (&Method::GET, "/console/assets/console.js") => {
            return asset(JS, "text/javascript; charset=utf-8")
        }
        (&Method::GET, "/console/login") => return pages::login(admin, None, StatusCode::OK),
        (&Method::POST, "/console/login") => return login(admin, req, peer).await,
        _ => {}
    }
    let now = admin.app.claims.clock().now_ms();
    let cookie = req
        .headers()
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .collect::<Vec<_>>()
        .join("; ");
    // The signature says the cookie was made here; the store says the session is still open.
    let session = match admin.sessions.check(&cookie, &admin.access, now) {
        Some(s) => match super::live_sessions::live(admin, s, now).await {
            Ok(s) => s,
            Err(e) => {
                return pages::message(
                    None,
                    StatusCode::SERVICE_UNAVAILABLE,
                    "Store unavailable",
                    &format!("{e}: the session cannot be checked; try again."),
                    "/console/",
                )
            }
        },
        None => None,
    };
    if method == Method::GET {
        let Some(session) = session else {
            if req.uri().query().is_some_and(|q| q.contains("fragment=1")) {
                return text(StatusCode::UNAUTHORIZED, "log in again");
            }
            return redirect("/console/login");
        };
        let query = parse_query(req.uri().query().unwrap_or(""));
        return match path.as_str() {
            "/console/" => pages::waiting(admin, &session, &query).await,
            "/console/keys" => pages::keys(admin, &session, &query).await,
            "/console/overview" => pages::overview(admin, &session).await,
            "/console/spend" => pages::spend(admin, &session, &query).await,
            "/console/sessions" => sessions_page::list(admin, &session, &query).await,
            _ => pages::message(
                Some(&session),
                StatusCode::NOT_FOUND,
                "Not found",
                "No such page.",
                "/console/",
            ),
        };
    }
    if method != Method::POST {
        return text(StatusCode::METHOD_NOT_ALLOWED, "use GET or POST");
    }
    act(admin, req, session, &path).await
}

/// A form's action. Every one needs a session, a same-origin request, and the session's
/// CSRF token.
async fn act(
    admin: &Admin,
    req: Request<Incoming>,
    session: Option<Session>,
    path: &str,
) -> Response<Body> {
    let Some(session) = session else {
        return pages::message(
            None,
            StatusCode::UNAUTHORIZED,
            "Not logged in",
            "Log in first: this action needs a session.",
            "/console/login",
        );
    };
    let refuse =
        |status, text: &str| pages::message(Some(&session), status, "Refused", text, "/console/");
    if !same_origin(&req) {
        return refuse(
            StatusCode::FORBIDDEN,
            "This form was sent from another site.",
        );
    }
    let form = match form(req).await {
        Ok(f) => f,
        Err(detail) => return refuse(StatusCode::BAD_REQUEST, &detail),
    };
    if !form
        .get("csrf")
        .is_some_and(|t| csrf_matches(t, &session.csrf))
    {
        return refuse(
            StatusCode::FORBIDDEN,
            "The form's CSRF token is missing or not this session's: reload the page and try again.",
        );
    }
    match path {
        "/console/logout" => logout(admin, &session).await,
        "/console/sessions/end" => sessions_page::end(admin, &session, &form).await,
        "/console/approvals/decide" => pages::decide(admin, &session, &form).await,
        "/console/held/release" => pages::resolve(admin, &session, &form, false).await,
        "/console/held/attest" => pages::resolve(admin, &session, &form, true).await,
        "/console/spend/freeze" => pages::freeze(admin, &session, &form, true).await,
        "/console/spend/unfreeze" => pages::freeze(admin, &session, &form, false).await,
        _ => pages::message(
            Some(&session),
            StatusCode::NOT_FOUND,
            "Not found",
            "No such action.",
            "/console/",
        ),
    }
}

/// Ends the session in the store (every proxy refuses its cookie from now on) and in this
/// browser.
async fn logout(admin: &Admin, session: &Session) -> Response<Body> {
    let mut resp = match admin.app.spend.store().end_session(&session.id).await {
        Ok(_) => redirect("/console/login"),
        Err(e) => pages::message(
            None,
            StatusCode::SERVICE_UNAVAILABLE,
            "Not logged out everywhere",
            &format!("{e}: the cookie is cleared in this browser, but the session could not be ended in the store; log in and out again when the store is back, or ask an operator to end it."),
            "/console/login",
        ),
    };
    set_cookie(&mut resp, &admin.sessions.end());
    resp
}

/// Checks a token, starts a session. Failed attempts per client address are limited.
async fn login(admin: &Admin, req: Request<Incoming>, peer: IpAddr) -> Response<Body> {
    let now = admin.app.claims.clock().now_ms();
    if let Err(wait) = admin.throttle.check(peer, now) {
        let mut resp = pages::login(
            admin,
            Some(&format!(
                "Too many failed logins from this address: wait {wait} s."
            )),
            StatusCode::TOO_MANY_REQUESTS,
        );
        if let Ok(v) = HeaderValue::from_str(&wait.to_string()) {
            resp.headers_mut().insert(header::RETRY_AFTER, v);
        }
        return resp;
    }
    if !same_origin(&req) {
        return pages::login(
            admin,
            Some("This form was sent from another site."),
            StatusCode::FORBIDDEN,
        );
    }
    let form = match form(req).await {
        Ok(f) => f,
        Err(detail) => return pages::login(admin, Some(&detail), StatusCode::BAD_REQUEST),
    };
    let token = form.get("token").map(|t| t.trim()).unwrap_or_default();
    match admin.access.check(token) {
        Some(who) => {
            tracing::info!(target: "idemproxy::audit", by = %who.name, role = who.role.as_str(), "console login");
            match super::live_sessions::open(admin, &who, now).await {
                Ok(cookie) => {
                    let mut resp = redirect("/console/");
                    set_cookie(&mut resp, &cookie);
                    resp
                }
                Err(e) => pages::login(
                    admin,
                    Some(&format!("{e}: no session can be started; try again.")),
                    StatusCode::SERVICE_UNAVAILABLE,
                ),
            }
        }
        None => {
            admin.throttle.failed(peer, now);
            tracing::warn!(%peer, "console login with a token that is not valid");
            pages::login(
                admin,
                Some("That token is not valid."),
                StatusCode::UNAUTHORIZED,
            )
        }
    }
}

/// A form body (`application/x-www-form-urlencoded`, at most 64 KiB), by field name.
async fn form(req: Request<Incoming>) -> Result<HashMap<String, String>, String> {
    let is_form = req
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/x-www-form-urlencoded"));
    if !is_form {
        return Err("Send the form as application/x-www-form-urlencoded.".into());
    }
    let bytes = read_limited(req.into_body(), MAX_FORM)
        .await
        .map_err(|e| format!("Cannot read the form: {e}"))?;
    Ok(form_urlencoded::parse(&bytes).into_owned().collect())
}

fn parse_query(q: &str) -> HashMap<String, String> {
    form_urlencoded::parse(q.as_bytes()).into_owned().collect()
}

/// When the browser says where a POST comes from (`Origin`), it must be this listener.
fn same_origin<B>(req: &Request<B>) -> bool {
    let Some(origin) = req
        .headers()
        .get(header::ORIGIN)
        .and_then(|v| v.to_str().ok())
    else {
        return true;
    };
    let host = req
        .headers()
        .get(header::HOST)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default();
    let origin_host = origin
        .strip_prefix("https://")
        .or_else(|| origin.strip_prefix("http://"))
        .unwrap_or("");
    !host.is_empty() && origin_host.eq_ignore_ascii_case(host)
}

/// The headers every console response carries.
fn secure(resp: &mut Response<Body>) {
    let h = resp.headers_mut();
    h.insert("content-security-policy", HeaderValue::from_static(CSP));
    h.insert(
        "x-content-type-options",
        HeaderValue::from_static("nosniff"),
    );
    h.insert("x-frame-options", HeaderValue::from_static("DENY"));
    // Not `no-referrer`: under it browsers send `Origin: null` with the console's own forms.
    h.insert("referrer-policy", HeaderValue::from_static("same-origin"));
    h.insert(
        "cross-origin-opener-policy",
        HeaderValue::from_static("same-origin"),
    );
}

fn page(status: StatusCode, body: String) -> Response<Body> {
    let mut resp = Response::new(full(body));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/html; charset=utf-8"),
    );
    resp.headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    secure(&mut resp);
    resp
}

/// Renders a template; a template that cannot render is a 500 with a plain message.
fn render(status: StatusCode, t: &impl Template) -> Response<Body> {
    match t.render() {
        Ok(html) => page(status, html),
        Err(e) => {
            tracing::error!(error = %e, "a console page did not render");
            text(
                StatusCode::INTERNAL_SERVER_ERROR,
                "the page did not render; see the log",
            )
        }
    }
}

fn text(status: StatusCode, body: &'static str) -> Response<Body> {
    let mut resp = Response::new(full(body));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    secure(&mut resp);
    resp
}

fn asset(body: &'static str, content_type: &'static str) -> Response<Body> {
    let mut resp = Response::new(full(body));
    resp.headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    resp.headers_mut().insert(
        header::CACHE_CONTROL,
        HeaderValue::from_static("private, max-age=300"),
    );
    secure(&mut resp);
    resp
}

/// 303 to `to` (a path of ours; never one taken from the request).
pub(super) fn redirect(to: &'static str) -> Response<Body> {
    redirect_to(to.to_string())
}

fn redirect_to(to: String) -> Response<Body> {
    let mut resp = Response::new(full(""));
    *resp.status_mut() = StatusCode::SEE_OTHER;
    if let Ok(v) = HeaderValue::from_str(&to) {
        resp.headers_mut().insert(header::LOCATION, v);
    }
    secure(&mut resp);
    resp
}

fn set_cookie(resp: &mut Response<Body>, value: &str) {
    if let Ok(v) = HeaderValue::from_str(value) {
        resp.headers_mut().append(header::SET_COOKIE, v);
    }
}

/// Whether `session` may do what `needs` may.
fn may(session: &Session, needs: Role) -> bool {
    session.who.role >= needs
}
