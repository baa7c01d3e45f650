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
use crate::spend::port::{Approval, ApprovalState, Freeze, FreezeTarget};

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
    probes: Vec<ProbeRefusalView>,
}

/// An MCP endpoint refusing the annotation probe, as the overview shows it.
struct ProbeRefusalView {
    route: String,
    endpoint: String,
    first: String,
    last: String,
    count: u64,
    answer: String,
}

/// The MCP endpoints of routes that trust annotations whose server refuses the probe now.
fn probe_refusals(admin: &Admin, now: u64) -> Vec<ProbeRefusalView> {
    let mut out = Vec::new();
    for route in admin.app.routes.all().iter() {
        let Some(rules) = &route.mcp else { continue };
        for r in rules.annotations.refusals() {
            out.push(ProbeRefusalView {
                route: route.name.clone(),
                endpoint: crate::redact::text(&r.endpoint),
                first: views::clock(r.first_ms),
                last: format!(
                    "{} ({})",
                    views::clock(r.last_ms),
                    views::ago(now, r.last_ms)
                ),
                count: r.count,
                answer: r.answer,
            });
        }
    }
    out
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
    let pending = admin
        .app
        .spend
        .store()
        .pending(now)
        .await
        .map(|p| p.len())
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
            probes: probe_refusals(admin, now),
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
    csrf: String,
    role: &'static str,
    can_freeze: bool,
    budgets: Vec<BudgetRow>,
    routes: Vec<FreezeRow>,
    freezes: Vec<FreezeRow>,
}

/// Something an operator may freeze (or has frozen): the form's hidden fields.
struct FreezeRow {
    scope: &'static str,
    tenant: String,
    run: String,
    route: String,
    /// `the tenant acme`
    what: String,
    frozen: bool,
    /// Who froze it and why, when frozen.
    note: String,
}

impl FreezeRow {
    fn of(target: &FreezeTarget, frozen: Option<&Freeze>) -> FreezeRow {
        let (scope, tenant, run, route) = match target {
            FreezeTarget::Tenant(t) => ("tenant", t.clone(), String::new(), String::new()),
            FreezeTarget::Run { tenant, run } => {
                ("run", tenant.clone(), run.clone(), String::new())
            }
            FreezeTarget::Route(r) => ("route", String::new(), String::new(), r.clone()),
        };
        FreezeRow {
            scope,
            tenant,
            run,
            route,
            what: FreezeTarget::describe(&target.key()),
            frozen: frozen.is_some(),
            note: frozen
                .map(|f| format!("frozen by {} {}: {}", f.by, views::clock(f.at_ms), f.reason))
                .unwrap_or_default(),
        }
    }

    fn from_key(key: &str) -> Option<FreezeTarget> {
        let (kind, rest) = key.split_once(':')?;
        Some(match kind {
            "tenant" => FreezeTarget::Tenant(rest.to_string()),
            "run" => {
                let (tenant, run) = rest.split_once('/')?;
                FreezeTarget::Run {
                    tenant: tenant.to_string(),
                    run: run.to_string(),
                }
            }
            "route" => FreezeTarget::Route(rest.to_string()),
            _ => return None,
        })
    }
}

/// One budget to show: its label, its counter, its cap (money or executions) and window.
#[derive(Debug)]
struct Wanted {
    label: String,
    key: String,
    cap: Option<i64>,
    counts: bool,
    window: crate::spend::budget::Window,
    target: FreezeTarget,
}

/// Every budget of a route to show, from its one list of caps: each cap over a tenant for
/// every tenant, over a run for every run named, over the route once. A money budget that
/// only counts (no limit of its own) is shown where the route limits money at all.
fn wanted(
    route: &str,
    b: &crate::spend::budget::Budget,
    tenants: &[String],
    runs: &[(String, String)],
) -> Vec<Wanted> {
    use crate::spend::caps::{Measure, Over};
    let mut out = Vec::new();
    let shown = b
        .caps
        .iter()
        .filter(|c| c.limits() || (c.measure == Measure::Money && b.limits_money()));
    for cap in shown {
        let whose: Vec<(String, Spender<'_>)> = match cap.over {
            Over::Tenant => tenants
                .iter()
                .map(|t| {
                    let who = Spender {
                        route,
                        tenant: t,
                        run: "",
                    };
                    (format!("tenant {t}"), who)
                })
                .collect(),
            Over::Run => runs
                .iter()
                .map(|(t, run)| {
                    let who = Spender {
                        route,
                        tenant: t,
                        run,
                    };
                    (format!("run {run} of {t}"), who)
                })
                .collect(),
            Over::Route => {
                let who = Spender {
                    route,
                    tenant: "",
                    run: "",
                };
                vec![("every tenant".to_string(), who)]
            }
        };
        for (label, who) in whose {
            out.push(Wanted {
                label: format!("{label}{}", cap.what()),
                key: cap.key(&who),
                cap: cap.limit,
                counts: cap.measure != Measure::Money,
                window: cap.window,
                target: FreezeTarget::of(cap.over, &who),
            });
        }
    }
    out
}

/// The budgets of one route ([`wanted`]) with what each holds now.
async fn route_budgets(
    admin: &Admin,
    route: &str,
    b: &crate::spend::budget::Budget,
    tenants: &[String],
    runs: &[(String, String)],
    now: u64,
    freezes: &[Freeze],
) -> Result<Vec<BudgetRow>, crate::idempotency::store::StoreError> {
    let wanted = wanted(route, b, tenants, runs);
    let mut rows = Vec::new();
    for w in wanted {
        // What the gate counts: since the window's start (a rolling span, or midnight).
        let window_ms = now.saturating_sub(b.since(w.window, now));
        let spent = admin
            .app
            .spend
            .store()
            .spent(&w.key, window_ms, now)
            .await?;
        let shown = |v: i64| {
            if w.counts {
                format!("{v} executions")
            } else {
                Money::new(v, b.caps_currency).to_string()
            }
        };
        let key = w.target.key();
        rows.push(BudgetRow {
            route: route.to_string(),
            who: w.label,
            kind: if w.counts { "count" } else { "money" },
            spent: shown(spent),
            cap: w.cap.map(shown).unwrap_or_else(|| "no cap".into()),
            window: match w.window {
                crate::spend::budget::Window::Rolling(d) => views::span(d.as_millis() as u64),
                calendar => b.describe(calendar),
            },
            percent: w
                .cap
                .filter(|c| *c > 0)
                .map(|c| {
                    ((spent.max(0) as f64 / c as f64) * 100.0)
                        .round()
                        .min(999.0) as u32
                })
                .unwrap_or(0),
            freeze: FreezeRow::of(&w.target, freezes.iter().find(|f| f.target == key)),
        });
    }
    Ok(rows)
}

struct BudgetRow {
    route: String,
    who: String,
    /// `money` or `count`.
    kind: &'static str,
    spent: String,
    cap: String,
    window: String,
    percent: u32,
    freeze: FreezeRow,
}

/// Every route's tenant budgets (money and counts), the runs approvals named (and one looked
/// up), nearest to their caps first; the freezes in effect, and a freeze button per row.
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
    let freezes = match admin.app.spend.store().freezes().await {
        Ok(f) => f,
        Err(e) => {
            error = Some(format!("The freezes could not be read: {e}"));
            Vec::new()
        }
    };
    let looked_up = (!q_run.is_empty()).then(|| {
        let t = if q_tenant.is_empty() {
            crate::auth::DEFAULT_TENANT.to_string()
        } else {
            q_tenant.clone()
        };
        (t, q_run.clone())
    });
    let mut routes = Vec::new();
    for route in admin.app.routes.all() {
        let Some(spend) = &route.spend else { continue };
        let target = FreezeTarget::Route(route.name.clone());
        let key = target.key();
        routes.push(FreezeRow::of(
            &target,
            freezes.iter().find(|f| f.target == key),
        ));
        let mut runs: Vec<(String, String)> = approvals
            .iter()
            .filter(|a| a.route == route.name)
            .map(|a| (a.tenant.clone(), a.run.clone()))
            .chain(looked_up.clone())
            .collect();
        runs.sort();
        runs.dedup();
        match route_budgets(
            admin,
            &route.name,
            &spend.budget,
            &tenants,
            &runs,
            now,
            &freezes,
        )
        .await
        {
            Ok(mut found) => rows.append(&mut found),
            Err(e) => error = Some(format!("The spend store did not answer: {e}")),
        }
    }
    rows.sort_by(|a, b| b.percent.cmp(&a.percent).then(a.route.cmp(&b.route)));
    let frozen = freezes
        .iter()
        .filter_map(|f| Some(FreezeRow::of(&FreezeRow::from_key(&f.target)?, Some(f))))
        .collect();
    let flash = match q("done").as_str() {
        "frozen" => Some(Flash {
            kind: "ok",
            text: format!("Frozen: {}.", q("what")),
        }),
        "unfrozen" => Some(Flash {
            kind: "ok",
            text: format!("Freeze lifted: {}.", q("what")),
        }),
        _ => None,
    };
    render(
        StatusCode::OK,
        &Spend {
            nav: "spend",
            user: Some(UserView::of(session)),
            flash,
            error,
            q_run,
            q_tenant,
            csrf: session.csrf.clone(),
            role: session.who.role.as_str(),
            can_freeze: may(session, Role::Operator),
            budgets: rows,
            routes,
            freezes: frozen,
        },
    )
}

/// The spend page's freeze and unfreeze buttons: the same operation as the freezes API.
pub async fn freeze(
    admin: &Admin,
    session: &Session,
    form: &HashMap<String, String>,
    freeze: bool,
) -> Response<Body> {
    if !may(session, Role::Operator) {
        return forbidden(session, "freeze or unfreeze spend");
    }
    let field = |k: &str| {
        form.get(k)
            .map(|v| v.trim().to_string())
            .filter(|v| !v.is_empty())
    };
    let order = crate::admin::freezes::Order {
        scope: field("scope").unwrap_or_default(),
        tenant: field("tenant"),
        run: field("run"),
        route: field("route"),
        by: None,
        reason: field("reason"),
    };
    let who = &session.who;
    match crate::admin::freezes::apply(admin, who, &who.name, "console", &order, freeze).await {
        Ok(v) => {
            let what = v["what"]
                .as_str()
                .or_else(|| v["freeze"]["what"].as_str())
                .unwrap_or_default()
                .to_string();
            let q: String = form_urlencoded::Serializer::new(String::new())
                .append_pair("done", if freeze { "frozen" } else { "unfrozen" })
                .append_pair("what", &what)
                .finish();
            redirect_to(format!("/console/spend?{q}"))
        }
        Err(p) => message(
            Some(session),
            p.status,
            p.title,
            &p.detail,
            "/console/spend",
        ),
    }
}

#[cfg(test)]
mod budget_tests {
    use std::collections::BTreeMap;
    use std::time::Duration;

    use super::{wanted, Spender};
    use crate::spend::budget::{Attempt, Budget, BudgetText, Cost, Price, ToolCounts};
    use crate::spend::caps::{Measure, Over};
    use crate::spend::money::{Currency, Money};

    /// A section that sets every cap there is: money, executions and one tool's executions,
    /// over the run, the tenant and the route, and both thresholds.
    fn every_cap() -> Budget {
        let rates = BTreeMap::new();
        let all = ToolCounts {
            per_run: Some(2),
            per_tenant: Some(3),
            per_route: Some(4),
        };
        let tools = BTreeMap::from([("create_refund".to_string(), all)]);
        let amount = ["{body.amount}".to_string()];
        Budget::parse(&BudgetText {
            amount: &amount,
            currency: "usd",
            unit: "minor",
            caps_currency: "usd",
            rates: &rates,
            per_request: Some("10.00"),
            per_run: Some("20.00"),
            per_tenant: Some("30.00"),
            per_route: Some("40.00"),
            count_per_run: Some(5),
            count_per_tenant: Some(6),
            count_per_route: Some(7),
            tenant_window: "1h",
            run_window: "2h",
            route_window: "calendar-day",
            time_zone: None,
            approve_above: Some("8.00"),
            approve_run_above: Some("15.00"),
            approve_tenant_above: Some("25.00"),
            approval_wait: Duration::from_secs(1),
            approval_expires: Duration::from_secs(60),
            exponents: &[],
            on_unpriced: Default::default(),
            tool_counts: &tools,
        })
        .expect("every cap")
    }

    /// Every kind of cap, walked through the one list: the budgets page shows each, under
    /// the counter the reservation counts it on, with the same cap and window. A cap added
    /// to the list is seen by both, or this fails.
    #[test]
    fn the_budgets_page_and_the_reservation_see_every_cap() {
        let b = every_cap();
        let mut kinds: Vec<(Over, u8)> = b
            .caps
            .iter()
            .map(|c| {
                let m = match &c.measure {
                    Measure::Money => 0,
                    Measure::Count => 1,
                    Measure::ToolCount(_) => 2,
                };
                (c.over, m)
            })
            .collect();
        kinds.sort();
        let expected: Vec<(Over, u8)> = Over::ALL
            .iter()
            .flat_map(|o| (0..3).map(move |m| (*o, m)))
            .collect();
        assert_eq!(kinds, expected, "one cap of each kind over each scope");

        let who = Spender {
            route: "pay",
            tenant: "acme",
            run: "r1",
        };
        let shown = wanted(
            "pay",
            &b,
            &["acme".to_string()],
            &[("acme".to_string(), "r1".to_string())],
        );
        let usd = Currency::parse("usd").expect("usd");
        let cost = Cost::Priced(Price {
            asked: Money::new(100, usd),
            counted: Money::new(100, usd),
        });
        let attempt = Attempt {
            token: "t",
            who: &who,
            cost: &cost,
            replaces: None,
            enforce: true,
            tool: Some("create_refund"),
        };
        let reserved = b.reservation(&attempt, false, 10_000_000);
        assert_eq!(reserved.counters.len(), b.caps.iter().count());
        for cap in b.caps.iter() {
            let key = cap.key(&who);
            let row = shown.iter().find(|w| w.key == key);
            let row = row.unwrap_or_else(|| panic!("the budgets page misses {cap:?}: {shown:?}"));
            assert_eq!((row.cap, row.window), (cap.limit, cap.window), "{key}");
            assert_eq!(row.counts, cap.measure != Measure::Money, "{key}");
            let counter = reserved.counters.iter().find(|c| c.key == key);
            let counter = counter.unwrap_or_else(|| panic!("the reservation misses {key}"));
            assert_eq!(counter.cap, cap.limit, "{key}");
            assert_eq!(counter.name, cap.name, "{key}");
        }
        assert_eq!(shown.len(), b.caps.iter().count(), "{shown:?}");
        // Metrics see every cap too (each at 0 from the start).
        let names = b.cap_names();
        for name in crate::spend::caps::CapName::ALL {
            assert!(names.contains(&name.as_str()), "{names:?} misses {name:?}");
        }
        // Both thresholds reach the reservation; approved, none does.
        assert_eq!(reserved.approvals.len(), 2);
        assert!(b
            .reservation(&attempt, true, 10_000_000)
            .approvals
            .is_empty());
    }
}
