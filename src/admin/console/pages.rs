//! The pages and the actions behind their forms. Actions call the same operations as the
//! JSON API (`approvals::decide`, `keys::resolve_held`), then send the browser back to the
//! page with a short note of what happened.

use std::collections::HashMap;

use askama::Template;
use bytes::Bytes;
use http::{Response, StatusCode};

use super::views::{self, ApprovalView, Flash, HeldView, RecordView, UserView};

/// A query parameter, trimmed; empty when absent.
fn param(query: &HashMap<String, String>, k: &str) -> String {
    query
        .get(k)
        .map(|v| v.trim().to_string())
        .unwrap_or_default()
}
use super::{may, redirect_to, render};
use crate::admin::access::Role;
use crate::admin::approvals::{self, Decided};
use crate::admin::keys::{self, Held, HeldDecision};
use crate::admin::session::Session;
use crate::admin::Admin;
use crate::http::body::Body;
use crate::idempotency::record::Receipt;
use crate::spend::budget::Spender;
use crate::spend::gate::approval_id;
use crate::spend::money::Money;
use crate::spend::port::{Approval, ApprovalState};

#[derive(Template)]
#[template(path = "console/login.html")]
struct Login {
    nav: &'static str,
    user: Option<UserView>,
    flash: Option<Flash>,
    ttl: String,
}

pub fn login(admin: &Admin, error: Option<&str>, status: StatusCode) -> Response<Body> {
    render(
        status,
        &Login {
            nav: "",
            user: None,
            flash: error.map(|e| Flash {
                kind: "error",
                text: e.to_string(),
            }),
            ttl: views::span(admin.sessions.ttl_ms()),
        },
    )
}

#[derive(Template)]
#[template(path = "console/message.html")]
struct Message<'a> {
    nav: &'static str,
    user: Option<UserView>,
    flash: Option<Flash>,
    heading: &'a str,
    kind: &'static str,
    text: &'a str,
    back: &'a str,
}

pub fn message(
    session: Option<&Session>,
    status: StatusCode,
    heading: &str,
    text: &str,
    back: &str,
) -> Response<Body> {
    render(
        status,
        &Message {
            nav: "",
            user: session.map(UserView::of),
            flash: None,
            heading,
            kind: if status.is_success() { "ok" } else { "error" },
            text,
            back,
        },
    )
}

#[derive(Template)]
#[template(path = "console/waiting.html")]
struct Waiting {
    nav: &'static str,
    user: Option<UserView>,
    flash: Option<Flash>,
    error: Option<String>,
    csrf: String,
    role: &'static str,
    can_approve: bool,
    can_resolve: bool,
    approvals: Vec<ApprovalView>,
    held: Vec<HeldView>,
}

/// The landing page: approvals waiting for a person, and outcomes held as UNKNOWN.
pub async fn waiting(
    admin: &Admin,
    session: &Session,
    query: &HashMap<String, String>,
) -> Response<Body> {
    let now = admin.app.claims.clock().now_ms();
    let mut errors = Vec::new();
    let approvals = match approvals::all(admin).await {
        Ok(all) => all
            .iter()
            .filter(|a| a.state == ApprovalState::Pending && !a.expired(now))
            .map(|a| ApprovalView::of(a, now))
            .collect(),
        Err(e) => {
            errors.push(format!("Approvals could not be read: {e}"));
            Vec::new()
        }
    };
    let held = match admin
        .held
        .list(admin.app.claims.store().as_ref(), admin.list_limit)
        .await
    {
        Ok(found) => found.iter().map(|(s, r)| HeldView::of(s, r, now)).collect(),
        Err(e) => {
            errors.push(format!("Held outcomes could not be read: {e}"));
            Vec::new()
        }
    };
    render(
        StatusCode::OK,
        &Waiting {
            nav: "waiting",
            user: Some(UserView::of(session)),
            flash: flash(query),
            error: (!errors.is_empty()).then(|| errors.join(" ")),
            csrf: session.csrf.clone(),
            role: session.who.role.as_str(),
            can_approve: may(session, Role::Approver),
            can_resolve: may(session, Role::Operator),
            approvals,
            held,
        },
    )
}

/// What the last action did, from the fixed words the actions redirect with.
fn flash(query: &HashMap<String, String>) -> Option<Flash> {
    let id = query.get("id").map(String::as_str).unwrap_or("");
    let text = match query.get("done").map(String::as_str)? {
        "approved" => format!("Approved {id}: the waiting request goes ahead."),
        "first" => {
            format!("Your approval of {id} is recorded; a second approver must approve too.")
        }
        "denied" => format!("Denied {id}: the waiting request is refused."),
        "released" => "Released: the next retry executes.".to_string(),
        "committed" => {
            "Recorded as happened (operator-attested): retries get that response.".to_string()
        }
        _ => return None,
    };
    Some(Flash { kind: "ok", text })
}

/// Approve or deny, from the landing page.
pub async fn decide(
    admin: &Admin,
    session: &Session,
    form: &HashMap<String, String>,
) -> Response<Body> {
    if !may(session, Role::Approver) {
        return forbidden(session, "approve or deny");
    }
    let id = form.get("id").map(String::as_str).unwrap_or("");
    let reason = form.get("reason").cloned();
    let to = match form.get("decision").map(String::as_str) {
        Some("approve") => ApprovalState::Approved,
        Some("deny") if reason.as_deref().is_some_and(|r| !r.trim().is_empty()) => {
            ApprovalState::Denied
        }
        Some("deny") => {
            return answer(
                session,
                StatusCode::BAD_REQUEST,
                "Say why",
                "A denial needs a reason: the agent's operator reads it.",
            )
        }
        _ => {
            return answer(
                session,
                StatusCode::BAD_REQUEST,
                "Refused",
                "Choose approve or deny.",
            )
        }
    };
    let who = &session.who;
    match approvals::decide(admin, who, &who.name, "console", id, reason, to).await {
        Ok(Decided::Final(a)) => done(
            if a.state == ApprovalState::Approved {
                "approved"
            } else {
                "denied"
            },
            &a.id,
        ),
        Ok(Decided::FirstOfTwo(a)) => done("first", &a.id),
        Err(p) => answer(session, p.status, p.title, &p.detail),
    }
}

/// Release a held outcome, or commit it as happened (operator-attested).
pub async fn resolve(
    admin: &Admin,
    session: &Session,
    form: &HashMap<String, String>,
    happened: bool,
) -> Response<Body> {
    if !may(session, Role::Operator) {
        return forbidden(session, "resolve held outcomes");
    }
    let field = |k: &str| {
        form.get(k)
            .map(|v| v.trim().to_string())
            .unwrap_or_default()
    };
    let (scope, token, why) = (field("scope"), field("token"), field("reason"));
    if why.is_empty() {
        return answer(
            session,
            StatusCode::BAD_REQUEST,
            "Say why",
            "Resolving a held outcome needs a reason: it goes to the audit trail.",
        );
    }
    let decision = if happened {
        if field("object").is_empty() {
            return answer(
                session,
                StatusCode::BAD_REQUEST,
                "Refused",
                "Give the provider's object id of what happened.",
            );
        }
        let status = match field("status").parse::<u16>() {
            Ok(s) if (100..=599).contains(&s) => s,
            _ => {
                return answer(
                    session,
                    StatusCode::BAD_REQUEST,
                    "Refused",
                    "The status must be an HTTP status (100-599).",
                )
            }
        };
        let body = form.get("body").cloned().unwrap_or_default();
        let headers = if body.trim_start().starts_with('{') {
            vec![("content-type".to_string(), "application/json".to_string())]
        } else {
            Vec::new()
        };
        Held::Attest(Receipt {
            status,
            headers,
            body: Bytes::from(body),
        })
    } else {
        Held::Release
    };
    let held = HeldDecision {
        decision,
        why: Some(why),
        object: happened.then(|| field("object")),
    };
    let who = &session.who;
    match keys::resolve_held(admin, who, &who.name, "console", &scope, &token, held).await {
        Ok(action) => done(action, ""),
        Err(p) => answer(session, p.status, p.title, &p.detail),
    }
}

fn done(what: &str, id: &str) -> Response<Body> {
    let q: String = form_urlencoded::Serializer::new(String::new())
        .append_pair("done", what)
        .append_pair("id", id)
        .finish();
    redirect_to(format!("/console/?{q}"))
}

fn answer(session: &Session, status: StatusCode, heading: &str, text: &str) -> Response<Body> {
    message(Some(session), status, heading, text, "/console/")
}

fn forbidden(session: &Session, what: &str) -> Response<Body> {
    answer(
        session,
        StatusCode::FORBIDDEN,
        "Not allowed",
        &format!(
            "Your token ({}) has the {} role, which may not {what}.",
            session.who.name,
            session.who.role.as_str()
        ),
    )
}

#[derive(Template)]
#[template(path = "console/keys.html")]
struct Keys {
    nav: &'static str,
    user: Option<UserView>,
    flash: Option<Flash>,
    routes: Vec<String>,
    q_route: String,
    q_tenant: String,
    q_key: String,
    error: Option<String>,
    record: Option<RecordView>,
    show_body: bool,
    body_link: String,
}

/// One operation's record: by scope (from a list) or by route, tenant and key.
pub async fn keys(
    admin: &Admin,
    session: &Session,
    query: &HashMap<String, String>,
) -> Response<Body> {
    let q = |k: &str| param(query, k);
    let (q_route, q_key) = (q("route"), q("key"));
    let q_tenant = Some(q("tenant"))
        .filter(|t| !t.is_empty())
        .unwrap_or_else(|| crate::auth::DEFAULT_TENANT.to_string());
    let scope = if !q("scope").is_empty() {
        Some(Ok(q("scope")))
    } else if !q_key.is_empty() {
        Some(keys::scope_for(admin, &q_route, &q_tenant, &q_key))
    } else {
        None
    };
    let mut error = None;
    let mut record = None;
    let mut body_link = String::new();
    match scope {
        Some(Ok(scope)) => match admin.app.claims.store().get(&scope).await {
            Ok(Some(r)) => {
                let approval = admin
                    .app
                    .spend
                    .store()
                    .approval(&approval_id(&scope))
                    .await
                    .ok()
                    .flatten();
                body_link = format!(
                    "/console/keys?{}",
                    form_urlencoded::Serializer::new(String::new())
                        .append_pair("scope", &scope)
                        .append_pair("body", "1")
                        .finish()
                );
                record = Some(RecordView::of(&scope, &r, approval.as_ref()));
            }
            Ok(None) => {
                error = Some(format!(
                    "No record under {scope}: never claimed, released, or expired."
                ))
            }
            Err(e) => error = Some(format!("The store did not answer: {e}")),
        },
        Some(Err(e)) => error = Some(e),
        None => {}
    }
    render(
        StatusCode::OK,
        &Keys {
            nav: "keys",
            user: Some(UserView::of(session)),
            flash: None,
            routes: admin
                .app
                .routes
                .all()
                .iter()
                .map(|r| r.name.clone())
                .collect(),
            q_route,
            q_tenant,
            q_key,
            error,
            record,
            show_body: q("body") == "1",
            body_link,
        },
    )
}

#[derive(Template)]
#[template(path = "console/overview.html")]
struct Overview {
    nav: &'static str,
    user: Option<UserView>,
    flash: Option<Flash>,
    store_ok: bool,
    store: String,
    store_url: String,
    certs: String,
    reloads: Vec<(String, u64)>,
    routes: String,
    pending: usize,
    held: usize,
    since: String,
    outcomes: Vec<String>,
    traffic: Vec<TrafficRow>,
    unprotected: Vec<(String, u64)>,
}

struct TrafficRow {
    route: String,
    counts: Vec<u64>,
}

/// The outcomes seen (columns), a row per route, and the unprotected requests per route.
fn traffic_table(
    counts: &crate::admin::traffic::Counts,
) -> (Vec<String>, Vec<TrafficRow>, Vec<(String, u64)>) {
    use crate::admin::traffic::UNPROTECTED;
    let mut outcomes: Vec<String> = counts
        .keys()
        .map(|(_, o)| o.clone())
        .filter(|o| !o.starts_with(UNPROTECTED))
        .collect();
    outcomes.sort();
    outcomes.dedup();
    let mut routes: Vec<String> = counts.keys().map(|(r, _)| r.clone()).collect();
    routes.dedup();
    let rows = routes
        .iter()
        .map(|r| TrafficRow {
            route: r.clone(),
            counts: outcomes
                .iter()
                .map(|o| counts.get(&(r.clone(), o.clone())).copied().unwrap_or(0))
                .collect(),
        })
        .collect();
    let unprotected = counts
        .iter()
        .filter_map(|((r, o), n)| {
            let reason = o.strip_prefix(UNPROTECTED)?.replace('_', " ");
            Some((format!("{r}, {reason}"), *n))
        })
        .collect();
    (outcomes, rows, unprotected)
}

pub async fn overview(admin: &Admin, session: &Session) -> Response<Body> {
    let started = std::time::Instant::now();
    let ping = admin.app.claims.store().ping().await;
    let took = started.elapsed();
    let now = admin.app.claims.clock().now_ms();
    let metrics = admin.app.metrics.encode();
    let reloads = crate::admin::traffic::family(&metrics, "idemproxy_config_reloads_total{")
        .into_iter()
        .filter_map(|(l, v)| Some((l.get("result")?.clone(), v as u64)))
        .collect();
    let (counts, since_ms) = admin.traffic.last_hour(&admin.app.metrics);
    let (outcomes, traffic, unprotected) = traffic_table(&counts);
    let pending = approvals::all(admin)
        .await
        .map(|all| {
            all.iter()
                .filter(|a| a.state == ApprovalState::Pending && !a.expired(now))
                .count()
        })
        .unwrap_or(0);
    let held = admin
        .held
        .list(admin.app.claims.store().as_ref(), admin.list_limit)
        .await
        .map(|l| l.len())
        .unwrap_or(0);
    let certs = match &admin.app.connect.leaves {
        Some(leaves) => format!("{} leaf certificates cached", leaves.entries().await),
        None => "No CA configured: HTTPS interception is off.".into(),
    };
    render(
        StatusCode::OK,
        &Overview {
            nav: "overview",
            user: Some(UserView::of(session)),
            flash: None,
            store_ok: ping.is_ok(),
            store: match ping {
                Ok(()) => format!("Answers ({} ms round trip)", took.as_millis()),
                Err(e) => format!("Not answering: {e}"),
            },
            store_url: format!("namespace {}", admin.app.namespace),
            certs,
            reloads,
            routes: admin
                .app
                .routes
                .all()
                .iter()
                .map(|r| r.name.clone())
                .collect::<Vec<_>>()
                .join(", "),
            pending,
            held,
            since: if now.saturating_sub(since_ms) >= 3_500_000 {
                "last hour".to_string()
            } else {
                format!(
                    "since {} (the last {})",
                    views::clock(since_ms),
                    views::span(now.saturating_sub(since_ms))
                )
            },
            outcomes,
            traffic,
            unprotected,
        },
    )
}

#[derive(Template)]
#[template(path = "console/spend.html")]
struct Spend {
    nav: &'static str,
    user: Option<UserView>,
    flash: Option<Flash>,
    error: Option<String>,
    q_run: String,
    q_tenant: String,
    budgets: Vec<BudgetRow>,
}

/// The tenant budgets of one route, and the budgets of these runs on it.
async fn route_budgets(
    admin: &Admin,
    route: &str,
    b: &crate::spend::budget::Budget,
    tenants: &[String],
    runs: &[(String, String)],
    now: u64,
) -> Result<Vec<BudgetRow>, crate::idempotency::store::StoreError> {
    let mut wanted = Vec::new();
    for t in tenants {
        let who = Spender {
            route,
            tenant: t,
            run: "",
        };
        wanted.push((
            format!("tenant {t}"),
            who.tenant_counter(),
            b.per_tenant,
            b.tenant_window,
        ));
    }
    for (t, run) in runs {
        let who = Spender {
            route,
            tenant: t,
            run,
        };
        wanted.push((
            format!("run {run} of {t}"),
            who.run_counter(),
            b.per_run,
            b.run_window,
        ));
    }
    let mut rows = Vec::new();
    for (label, key, cap, window) in wanted {
        let window_ms = window.as_millis() as u64;
        let spent = admin.app.spend.store().spent(&key, window_ms, now).await?;
        rows.push(BudgetRow {
            route: route.to_string(),
            who: label,
            spent: Money::new(spent, b.caps_currency).to_string(),
            cap: cap
                .map(|c| c.to_string())
                .unwrap_or_else(|| "no cap".into()),
            window: views::span(window_ms),
            percent: cap
                .filter(|c| c.minor > 0)
                .map(|c| {
                    ((spent.max(0) as f64 / c.minor as f64) * 100.0)
                        .round()
                        .min(999.0) as u32
                })
                .unwrap_or(0),
        });
    }
    Ok(rows)
}

struct BudgetRow {
    route: String,
    who: String,
    spent: String,
    cap: String,
    window: String,
    percent: u32,
}

/// Every route's tenant budgets, the runs approvals named (and one looked up), nearest to
/// their caps first.
pub async fn spend(
    admin: &Admin,
    session: &Session,
    query: &HashMap<String, String>,
) -> Response<Body> {
    let now = admin.app.claims.clock().now_ms();
    let q = |k: &str| param(query, k);
    let (q_run, q_tenant) = (q("run"), q("tenant"));
    let approvals: Vec<Approval> = approvals::all(admin).await.unwrap_or_default();
    let tenants = admin.app.tenants.names();
    let mut rows = Vec::new();
    let mut error = None;
    let looked_up = (!q_run.is_empty()).then(|| {
        let t = if q_tenant.is_empty() {
            crate::auth::DEFAULT_TENANT.to_string()
        } else {
            q_tenant.clone()
        };
        (t, q_run.clone())
    });
    for route in admin.app.routes.all() {
        let Some(spend) = &route.spend else { continue };
        let mut runs: Vec<(String, String)> = approvals
            .iter()
            .filter(|a| a.route == route.name)
            .map(|a| (a.tenant.clone(), a.run.clone()))
            .chain(looked_up.clone())
            .collect();
        runs.sort();
        runs.dedup();
        match route_budgets(admin, &route.name, &spend.budget, &tenants, &runs, now).await {
            Ok(mut found) => rows.append(&mut found),
            Err(e) => error = Some(format!("The spend store did not answer: {e}")),
        }
    }
    rows.sort_by(|a, b| b.percent.cmp(&a.percent).then(a.route.cmp(&b.route)));
    render(
        StatusCode::OK,
        &Spend {
            nav: "spend",
            user: Some(UserView::of(session)),
            flash: None,
            error,
            q_run,
            q_tenant,
            budgets: rows,
        },
    )
}
