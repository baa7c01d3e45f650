//! Freezes: an operator stops every capped operation of a tenant, a run or a route at once,
//! and lifts the stop. Kept in the store (every proxy on it refuses at once: the reservation
//! checks freezes in the same step as the budgets) and written to the audit trail.

use http::{Method, Request, Response, StatusCode};
use hyper::body::Incoming;
use serde::Deserialize;

use super::access::{Principal, Role};
use super::{audit, json, problem, Admin};
use crate::http::body::{read_limited, Body};
use crate::http::problem::Problem;
use crate::spend::port::{Freeze, FreezeTarget};

const MAX_REQUEST: usize = 16 * 1024;

/// What to freeze or lift, as the API, the CLI and the console's forms name it.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct Order {
    /// `tenant`, `run` or `route`.
    pub scope: String,
    #[serde(default)]
    pub tenant: Option<String>,
    #[serde(default)]
    pub run: Option<String>,
    #[serde(default)]
    pub route: Option<String>,
    /// Who (with the shared token); a named token acts as its name.
    #[serde(default)]
    pub by: Option<String>,
    #[serde(default)]
    pub reason: Option<String>,
}

pub(super) async fn handle(
    admin: &Admin,
    who: &Principal,
    req: Request<Incoming>,
) -> Response<Body> {
    let (method, path) = (req.method().clone(), req.uri().path().to_string());
    let freeze =
        match (method, path.as_str()) {
            (Method::GET, "/v1/freezes") => return list(admin).await,
            (Method::POST, "/v1/freezes/freeze") => true,
            (Method::POST, "/v1/freezes/unfreeze") => false,
            _ => return problem(
                StatusCode::NOT_FOUND,
                "not-found",
                "Freezes API: GET /v1/freezes, POST /v1/freezes/freeze, POST /v1/freezes/unfreeze.",
            ),
        };
    if let Err(resp) = super::require(who, Role::Operator) {
        return *resp;
    }
    let order: Order = match read_limited(req.into_body(), MAX_REQUEST).await {
        Ok(bytes) => match serde_json::from_slice(&bytes) {
            Ok(o) => o,
            Err(e) => return bad(&format!("the request body is not valid: {e} (send {{\"scope\": \"tenant\"|\"run\"|\"route\", \"tenant\", \"run\", \"route\", \"by\", \"reason\"}})")),
        },
        Err(e) => return bad(&format!("cannot read the request body: {e}")),
    };
    let Some(by) = who.saying(order.by.as_deref()) else {
        return bad("by: say who freezes (a name or an email); it is recorded");
    };
    match apply(admin, who, &by, "api", &order, freeze).await {
        Ok(v) => json(StatusCode::OK, &v),
        Err(p) => p.into_response(),
    }
}

fn bad(detail: &str) -> Response<Body> {
    problem(StatusCode::BAD_REQUEST, "bad-request", detail)
}

async fn list(admin: &Admin) -> Response<Body> {
    match admin.app.spend.store().freezes().await {
        Ok(all) => json(
            StatusCode::OK,
            &serde_json::json!({"freezes": all.iter().map(view).collect::<Vec<_>>()}),
        ),
        Err(e) => problem(
            StatusCode::SERVICE_UNAVAILABLE,
            "store-unavailable",
            &format!("{e}; try again."),
        ),
    }
}

pub(super) fn view(f: &Freeze) -> serde_json::Value {
    serde_json::json!({
        "target": f.target,
        "what": FreezeTarget::describe(&f.target),
        "by": f.by,
        "principal": f.principal,
        "reason": f.reason,
        "at_ms": f.at_ms,
    })
}

/// The target an order names; a 400 naming the missing or bad field otherwise.
pub(super) fn target(admin: &Admin, o: &Order) -> Result<FreezeTarget, Problem> {
    let bad = |m: String| Problem::new(StatusCode::BAD_REQUEST, "bad-request", m);
    let given = |v: &Option<String>| {
        v.as_deref()
            .map(str::trim)
            .filter(|v| !v.is_empty())
            .map(String::from)
    };
    let name_ok = |field: &str, v: &str| {
        if v.len() > crate::proxy::spending::MAX_RUN_LEN * 2 || v.contains(['/', ':']) {
            Err(bad(format!(
                "{field}: `{v}` is not a name the proxy gives out"
            )))
        } else {
            Ok(())
        }
    };
    match o.scope.trim() {
        "tenant" => {
            let t =
                given(&o.tenant).ok_or_else(|| bad("tenant: name the tenant to freeze".into()))?;
            name_ok("tenant", &t)?;
            Ok(FreezeTarget::Tenant(t))
        }
        "run" => {
            let run = given(&o.run).ok_or_else(|| bad("run: name the run to freeze".into()))?;
            let tenant =
                given(&o.tenant).unwrap_or_else(|| crate::auth::DEFAULT_TENANT.to_string());
            name_ok("tenant", &tenant)?;
            if run.len() > crate::proxy::spending::MAX_RUN_LEN {
                return Err(bad(format!("run: `{run}` is longer than a run id may be")));
            }
            Ok(FreezeTarget::Run { tenant, run })
        }
        "route" => {
            let route =
                given(&o.route).ok_or_else(|| bad("route: name the route to freeze".into()))?;
            if !admin.app.routes.all().iter().any(|r| r.name == route) {
                return Err(Problem::new(
                    StatusCode::NOT_FOUND,
                    "route-not-found",
                    format!("route: no route is named `{route}`"),
                ));
            }
            Ok(FreezeTarget::Route(route))
        }
        other => Err(bad(format!("scope: `{other}` is not tenant, run or route"))),
    }
}

/// Freezes (or lifts) what `o` names, as `by`, and records it in the audit trail.
pub(super) async fn apply(
    admin: &Admin,
    who: &Principal,
    by: &str,
    via: &'static str,
    o: &Order,
    freeze: bool,
) -> Result<serde_json::Value, Problem> {
    let target = target(admin, o)?;
    let key = target.key();
    let reason = o
        .reason
        .as_deref()
        .map(str::trim)
        .filter(|r| !r.is_empty())
        .map(String::from);
    let store = admin.app.spend.store();
    let unavailable = |e: crate::idempotency::store::StoreError| {
        Problem::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "store-unavailable",
            format!("{e}. Nothing was changed; try again."),
        )
    };
    let now = admin.app.claims.clock().now_ms();
    if freeze {
        let Some(reason) = reason.clone() else {
            return Err(Problem::new(
                StatusCode::BAD_REQUEST,
                "bad-request",
                "reason: say why (it goes to the audit trail and to the refused tools)",
            ));
        };
        let f = Freeze {
            target: key.clone(),
            by: by.to_string(),
            principal: Some(who.name.clone()),
            reason,
            at_ms: now,
        };
        store.freeze(&f).await.map_err(unavailable)?;
        admin.audit.record(&audit::about_freeze(
            "spend.frozen",
            who,
            by,
            via,
            now,
            &f.reason,
            &target,
        ));
        tracing::warn!(target = %key, %by, "spend frozen");
        Ok(serde_json::json!({"frozen": true, "freeze": view(&f)}))
    } else {
        let lifted = store.unfreeze(&key).await.map_err(unavailable)?;
        if !lifted {
            return Err(Problem::new(
                StatusCode::NOT_FOUND,
                "freeze-not-found",
                format!("{} is not frozen", FreezeTarget::describe(&key)),
            ));
        }
        let why = reason.unwrap_or_default();
        admin.audit.record(&audit::about_freeze(
            "spend.unfrozen",
            who,
            by,
            via,
            now,
            &why,
            &target,
        ));
        tracing::warn!(target = %key, %by, "spend freeze lifted");
        Ok(
            serde_json::json!({"frozen": false, "target": key, "what": FreezeTarget::describe(&key)}),
        )
    }
}
