//! The HTTP side of spend control: reads a money-moving request's cost and run, asks the
//! spend gate, and says why it refused (`ProxyError::Spend`, rendered like every refusal in
//! the route's provider's error shape by `proxy::error`).

use http::{HeaderMap, Method};

use std::sync::Arc;

use super::forward::Unsent;
use crate::idempotency::claims::Claim;
use crate::idempotency::outcome::Outcome;
use crate::idempotency::policy::Policy;
use crate::identity::{Identified, Identity};
use crate::proxy::error::ProxyError;
use crate::proxy::App;
use crate::request::Request;
use crate::routes::{Route, RouteSpend, RunSource};
use crate::spend::binding::{self, Bound};
use crate::spend::budget::{Cost, PriceError, Pricing, Spender};
use crate::spend::gate::{Admission, Charge, Gate, Ticket};
use crate::spend::money::Money;
use crate::spend::port::ToolCall;

/// The run the proxy user named on the CONNECT that opened an intercepted tunnel: requests
/// inside it carry no `Proxy-Authorization` of their own.
#[derive(Debug, Clone)]
pub struct TunnelRun(pub std::sync::Arc<str>);

/// Longest run id accepted (from the proxy user or a header).
pub const MAX_RUN_LEN: usize = 64;

pub use super::spend_error::SpendError;

/// Whether a request moves money on this route; its budget and run then apply.
pub fn applies<'r>(route: &'r Route, method: &Method, path: &str) -> Option<&'r RouteSpend> {
    route.spend.as_ref().filter(|s| s.covers(method, path))
}

/// A capped request without a business key (`why` it has none): an operation that may
/// derive its identity from the whole request (a charge) does; any other (money out, an
/// order) is refused with what to add, as is one a route identifies by its whole body: two
/// deliberate identical payouts must not silently become one. A capped request is never
/// forwarded unpriced.
pub fn derivable_without_key(
    route: &Route,
    spend: &RouteSpend,
    view: &Request<'_>,
    why: &str,
) -> Result<(), SpendError> {
    if spend.derives_without_key(view.method, view.path) {
        return Ok(());
    }
    Err(SpendError::KeyRequired(format!(
        "{why}. {} {} moves money or places an order, so it needs a business key: one per payment, the same on every retry — an Idempotency-Key header (`{}`) with key_source = \"client\", or a field the route's key template names",
        view.method,
        view.path,
        route.identity.key_header
    )))
}

/// What spend control knows of a capped request before its claim: what it costs, whose
/// budgets it counts against, and the canonical fingerprint it is priced (and approved) as.
pub struct Plan {
    pub cost: Cost,
    pub run: String,
    pub binding: String,
    /// What a person approving it reads in place of the request's body (a purchase: payee,
    /// amount, asset, network, resource — never the payment's signature).
    pub shown: Option<Vec<u8>>,
}

/// Prices a capped request and binds it to its canonical form; reads no store (`counted`:
/// whether the object a step names was counted at its creation, read by the caller). A
/// request the route identifies by its whole body is held to the rule for a request without
/// a key (`derivable_without_key`).
pub fn plan(
    route: &Route,
    spend: &RouteSpend,
    view: &Request<'_>,
    tunnel: Option<&TunnelRun>,
    identified: &Identified,
    counted: bool,
) -> Result<Plan, SpendError> {
    if matches!(identified.derived.identity, Identity::Request) {
        let why = "the route identifies this request by its whole body";
        derivable_without_key(route, spend, view, why)?;
    }
    let account = identified.derived.account.as_str();
    let pricing = spend
        .operation(view.method, view.path)
        .map(|o| &o.pricing)
        .unwrap_or(&Pricing::Amount(0));
    let cost = match pricing {
        Pricing::Counted { .. } if counted => Cost::Free,
        p => spend.budget.cost(view, p)?,
    };
    let run = run_of(spend, view.headers, tunnel)?.unwrap_or_else(|| view.tenant.to_string());
    let amount = match &cost {
        Cost::Priced(p) => p.asked.to_string(),
        Cost::Free | Cost::Unpriced(_) => String::new(),
    };
    let binding = binding::fingerprint(&Bound {
        method: view.method.as_str(),
        path: view.path,
        account,
        amount: &amount,
        content_type: view
            .headers
            .get(http::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok()),
        body: view.body,
        descriptive: &spend.descriptive,
    });
    Ok(Plan {
        cost,
        run,
        binding,
        shown: None,
    })
}

/// Plans a request on a capped x402 route: its `cost` read from the payment it carries (by
/// `proxy::purchase`), bound like any request but without the amount, since a purchase is
/// the same purchase whatever payment a retry carries (or none); `shown` is what an
/// approval shows of it.
pub fn plan_purchase(
    spend: &RouteSpend,
    view: &Request<'_>,
    tunnel: Option<&TunnelRun>,
    account: &str,
    cost: Cost,
    shown: Option<Vec<u8>>,
) -> Result<Plan, SpendError> {
    let run = run_of(spend, view.headers, tunnel)?.unwrap_or_else(|| view.tenant.to_string());
    let binding = binding::fingerprint(&Bound {
        method: view.method.as_str(),
        path: view.path,
        account,
        amount: "",
        content_type: view
            .headers
            .get(http::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok()),
        body: view.body,
        descriptive: &spend.descriptive,
    });
    Ok(Plan {
        cost,
        run,
        binding,
        shown,
    })
}

/// Prices a capped MCP tool call and binds it to the tool and its canonical arguments (never
/// the JSON-RPC id, `_meta` or the session, which change on every re-run). A call whose amount
/// cannot be read is `Unpriced`: the gate refuses it on a route with money limits, with a
/// message that tells the agent's model what to do. (`recorded`: what a tool priced from a
/// recorded object asks for, when the proxy recorded that object; read by the caller.)
pub fn plan_tool(
    spend: &RouteSpend,
    view: &Request<'_>,
    tunnel: Option<&TunnelRun>,
    account: &str,
    tool: &str,
    arguments: &serde_json::Value,
    recorded: Option<Money>,
) -> Result<Plan, SpendError> {
    let pricing = spend
        .operation(&http::Method::POST, &format!("/{tool}"))
        .map(|o| &o.pricing)
        .unwrap_or(&Pricing::Amount(0));
    let cost = match (pricing, recorded) {
        (Pricing::Recorded { .. }, Some(asked)) => Ok(Cost::Priced(spend.budget.price_of(asked)?)),
        (pricing, _) => spend.budget.cost(view, pricing),
    };
    let cost = match cost {
        Ok(cost) => cost,
        Err(PriceError::Unreadable(why)) => Cost::Unpriced(format!(
            "the tool {tool} is capped and this call carries no amount the route reads ({}); \
             call it again with its amount argument, or ask a person to make it",
            why.replace("{body.params.arguments.", "{args.")
        )),
        Err(e) => return Err(e.into()),
    };
    let run = run_of(spend, view.headers, tunnel)?.unwrap_or_else(|| view.tenant.to_string());
    let amount = match &cost {
        Cost::Priced(p) => p.asked.to_string(),
        Cost::Free | Cost::Unpriced(_) => String::new(),
    };
    let body = arguments.to_string();
    let binding = binding::fingerprint(&Bound {
        method: "POST",
        path: &format!("/{tool}"),
        account,
        amount: &amount,
        content_type: Some("application/json"),
        body: body.as_bytes(),
        descriptive: &spend.descriptive,
    });
    Ok(Plan {
        cost,
        run,
        binding,
        shown: None,
    })
}

/// Gives a reservation back when the outcome says the payment did not happen; counts the
/// spend (`idemproxy_spent`) when it did, or may have.
pub async fn settle(
    metrics: &crate::metrics::Metrics,
    route: &str,
    tenant: &str,
    ticket: Option<Ticket>,
    outcome: &Outcome,
) {
    let Some(mut ticket) = ticket else {
        return;
    };
    match outcome {
        // A call waiting for its continuation reserved nothing for the next round: the
        // continuation is priced and admitted again.
        Outcome::Released | Outcome::Declined | Outcome::Awaiting(_) => ticket.release().await,
        Outcome::Committed | Outcome::Unknown(_) | Outcome::Duplicate(_) => {
            // It happened, or may have: the reservation stays, whether or not the caller kept
            // the ticket when the attempt went out (a ticket dropped unkept gives it back).
            ticket.keep();
            if let (true, Some(asked)) = (ticket.added, ticket.asked) {
                let (currency, major) = asked.major();
                metrics.spent(route, tenant, currency, major);
            }
        }
    }
}

/// One executing attempt, through the gate: admitted with a reservation its token owns, or
/// parked for a person, or refused.
pub struct Attempting<'a> {
    pub scope: &'a str,
    pub token: &'a str,
    pub replaces: Option<&'a str>,
    pub approved: bool,
    /// An MCP tool call: an approval shows it (tool, account, arguments), not the
    /// JSON-RPC message it came in.
    pub tool: Option<&'a ToolAsked>,
}

/// A capped tool call as a person approving it reads it: the tool, the account's fingerprint,
/// and the canonical arguments (keys sorted; card data is redacted when it is parked). The
/// JSON-RPC id, `_meta` and the session are left out: they change on every re-run.
pub struct ToolAsked {
    pub call: ToolCall,
    pub arguments: Vec<u8>,
}

impl ToolAsked {
    pub fn new(tool: &str, account: &str, arguments: &serde_json::Value) -> ToolAsked {
        ToolAsked {
            call: ToolCall {
                name: tool.to_string(),
                account: account.to_string(),
            },
            // serde_json's map is sorted: this is the canonical spelling.
            arguments: serde_json::to_vec(arguments).unwrap_or_default(),
        }
    }
}

/// The method an approval of a tool call shows, beside the tool's name as its path.
pub const TOOL_CALL: &str = "tools/call";

pub async fn admit(
    gate: &Gate,
    route: &Route,
    spend: &RouteSpend,
    plan: &Plan,
    view: &Request<'_>,
    at: &Attempting<'_>,
) -> Result<Admission, SpendError> {
    let (method, path, body) = match at.tool {
        Some(t) => (TOOL_CALL, t.call.name.as_str(), t.arguments.as_slice()),
        None => (
            view.method.as_str(),
            view.path,
            plan.shown.as_deref().unwrap_or(view.body),
        ),
    };
    let ask = Charge {
        scope: at.scope,
        who: Spender {
            route: &route.name,
            tenant: view.tenant,
            run: &plan.run,
        },
        cost: plan.cost.clone(),
        binding: &plan.binding,
        method,
        path,
        body,
        tool: at.tool.map(|t| &t.call),
        enforce: spend.enforce,
        token: at.token,
        replaces: at.replaces,
    };
    Ok(gate.admit(&spend.budget, &ask, at.approved).await?)
}

/// The request's run, from the first source that has one. Inside an intercepted tunnel the
/// proxy user is the CONNECT's: a `Proxy-Authorization` inside the tunnel is never read, and
/// a header naming another run than the CONNECT did is refused.
fn run_of(
    spend: &RouteSpend,
    headers: &HeaderMap,
    tunnel: Option<&TunnelRun>,
) -> Result<Option<String>, SpendError> {
    if let Some(t) = tunnel {
        let named = spend.run_from.iter().find_map(|s| match s {
            RunSource::Header(name) => headers.get(name).map(|v| (name, v)),
            RunSource::ProxyUser => None,
        });
        if let Some((name, v)) = named {
            let v = v
                .to_str()
                .map_err(|_| SpendError::Run(format!("in {name} is not text")))?;
            if v.trim() != &*t.0 {
                return Err(SpendError::Run(format!(
                    "`{}` in {name} is not the run `{}` the tunnel's CONNECT named",
                    v.trim(),
                    t.0
                )));
            }
        }
        if spend.run_from.contains(&RunSource::ProxyUser) {
            check_run(&t.0)?;
            return Ok(Some(t.0.to_string()));
        }
    }
    for source in &spend.run_from {
        let found = match source {
            RunSource::ProxyUser if tunnel.is_some() => None,
            RunSource::ProxyUser => crate::auth::run_of_proxy_user(headers),
            RunSource::Header(name) => match headers.get(name) {
                Some(v) => Some(
                    v.to_str()
                        .map_err(|_| SpendError::Run(format!("in {name} is not text")))?
                        .trim()
                        .to_string(),
                ),
                None => None,
            },
        };
        if let Some(run) = found {
            check_run(&run)?;
            return Ok(Some(run));
        }
    }
    Ok(None)
}

fn check_run(run: &str) -> Result<(), SpendError> {
    if run.is_empty() || run.len() > MAX_RUN_LEN {
        return Err(SpendError::Run(format!(
            "is {} bytes; it must be 1 to {MAX_RUN_LEN}",
            run.len()
        )));
    }
    if !run
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b"._:-".contains(&b))
    {
        return Err(SpendError::Run(format!(
            "`{run}` holds a character other than letters, digits, '.', '_', ':' or '-'"
        )));
    }
    Ok(())
}

impl crate::spend::gate::SpendEvents for crate::metrics::Metrics {
    fn refused(&self, route: &str, cap: crate::spend::port::CapName) {
        self.spend_refused(route, cap.as_str());
    }

    fn approval(&self, route: &str, event: &'static str) {
        crate::metrics::Metrics::approval(self, route, event);
    }

    fn shadow(&self, route: &str, cap: crate::spend::port::CapName) {
        self.spend_shadow(route, cap.as_str());
    }

    fn frozen(&self, route: &str) {
        self.spend_refused(route, "frozen");
    }
}

/// What the spend gate made of a capped request's claim.
pub(super) enum Gated {
    /// Gated under the ticket: forward the claim.
    Forward(Box<Claim>, Ticket),
    /// Parked, and a person approved it. The claim was withdrawn while they decided (a
    /// wait must not hold it into a lapse): claim again, as approved.
    Approved,
    /// Refused; the claim was withdrawn.
    Refused(SpendError),
}

/// Puts a freshly taken claim through the spend gate: the one step between claiming and
/// forwarding that both the REST pipeline and MCP tool calls take. The claim is `Unsent`
/// throughout, so a client that goes away while the gate decides withdraws it.
#[allow(clippy::too_many_arguments)]
pub(super) async fn reserve(
    app: &App,
    policy: &Arc<Policy>,
    route: &Route,
    spend: &RouteSpend,
    plan: &Plan,
    view: &Request<'_>,
    scope: &str,
    claim: Claim,
    approved: bool,
    tool: Option<&ToolAsked>,
) -> Result<Gated, ProxyError> {
    // Read before the claim moves into its guard (two short strings per capped request).
    let token = claim.token.as_str().to_owned();
    let replaces = claim.replaces().map(str::to_owned);
    let unsent = Unsent {
        claims: app.claims.clone(),
        policy: policy.clone(),
        claim: Some(claim),
    };
    let at = Attempting {
        scope,
        token: &token,
        replaces: replaces.as_deref(),
        approved,
        tool,
    };
    Ok(
        match admit(&app.spend, route, spend, plan, view, &at).await {
            Ok(Admission::Admitted(ticket)) => match unsent.forward() {
                Some(claim) => Gated::Forward(Box::new(claim), ticket),
                None => {
                    return Err(ProxyError::BadRequest(
                        "internal: a claim went missing".into(),
                    ))
                }
            },
            Ok(Admission::Parked(approval)) => {
                unsent.withdraw().await;
                tracing::info!(route = %route.name, tool = tool.map(|t| t.call.name.as_str()), approval = %approval.id, "waits for a person's approval");
                match app.spend.wait(&spend.budget, &approval).await {
                    Ok(()) => Gated::Approved,
                    Err(refusal) => Gated::Refused(SpendError::Refused(refusal)),
                }
            }
            Err(error) => {
                unsent.withdraw().await;
                Gated::Refused(error)
            }
        },
    )
}
