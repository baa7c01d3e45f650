//! The Sessions page: an operator sees every console session open on the store and ends any
//! one (the same operation as `POST /v1/sessions/end`).

use std::collections::HashMap;

use askama::Template;
use http::{Response, StatusCode};

use super::views::{self, Flash, UserView};
use super::{may, pages, redirect_to, render};
use crate::admin::access::Role;
use crate::admin::live_sessions;
use crate::admin::session::Session;
use crate::admin::Admin;
use crate::http::body::Body;

struct SessionRow {
    id: String,
    name: String,
    role: String,
    started: String,
    expires: String,
    mine: bool,
}

#[derive(Template)]
#[template(path = "console/sessions.html")]
struct Sessions {
    nav: &'static str,
    user: Option<UserView>,
    flash: Option<Flash>,
    error: Option<String>,
    csrf: String,
    sessions: Vec<SessionRow>,
}

fn refused(session: &Session) -> Response<Body> {
    pages::message(
        Some(session),
        StatusCode::FORBIDDEN,
        "Not allowed",
        &format!(
            "Your token ({}) has the {} role: only an operator sees and ends sessions.",
            session.who.name,
            session.who.role.as_str()
        ),
        "/console/",
    )
}

pub async fn list(
    admin: &Admin,
    session: &Session,
    query: &HashMap<String, String>,
) -> Response<Body> {
    if !may(session, Role::Operator) {
        return refused(session);
    }
    let now = admin.app.claims.clock().now_ms();
    let (rows, error) = match live_sessions::open_now(admin, now).await {
        Ok(all) => (
            all.into_iter()
                .map(|k| SessionRow {
                    mine: k.id == session.id,
                    started: views::clock(k.started_ms),
                    expires: views::clock(k.expires_ms),
                    id: k.id,
                    name: k.name,
                    role: k.role,
                })
                .collect(),
            None,
        ),
        Err(e) => (
            Vec::new(),
            Some(format!("{e}: the sessions cannot be listed.")),
        ),
    };
    let flash = query.get("done").filter(|d| *d == "ended").map(|_| Flash {
        kind: "ok",
        text: "Session ended: its cookie is refused on every proxy.".into(),
    });
    render(
        if error.is_some() {
            StatusCode::SERVICE_UNAVAILABLE
        } else {
            StatusCode::OK
        },
        &Sessions {
            nav: "sessions",
            user: Some(UserView::of(session)),
            flash,
            error,
            csrf: session.csrf.clone(),
            sessions: rows,
        },
    )
}

pub async fn end(
    admin: &Admin,
    session: &Session,
    form: &HashMap<String, String>,
) -> Response<Body> {
    if !may(session, Role::Operator) {
        return refused(session);
    }
    let id = form.get("id").map(|v| v.trim()).unwrap_or_default();
    match live_sessions::end(admin, &session.who, "console", id).await {
        Ok(()) => redirect_to("/console/sessions?done=ended".into()),
        Err(p) => pages::message(
            Some(session),
            p.status,
            p.title,
            &p.detail,
            "/console/sessions",
        ),
    }
}
