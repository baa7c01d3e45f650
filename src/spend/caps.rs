//! A route's budgets as data: one list of caps, each saying over whose spend it runs (a run,
//! a tenant, the route), what it counts (money, executions, executions of one tool), in which
//! window, and above what a person must approve. The reservation, the console's budgets
//! page, freezes and metrics all walk this one list, so a cap added here is seen by each of
//! them; and a counter's key in the store is formatted by [`counter_key`] alone.

use std::time::Duration;

/// Whose spend a cap bounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Over {
    Run,
    Tenant,
    Route,
}

impl Over {
    /// Every scope, in the order a reservation checks them.
    pub const ALL: [Over; 3] = [Over::Run, Over::Tenant, Over::Route];
}

/// What a cap counts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Measure {
    /// Money, in minor units of the caps currency.
    Money,
    /// Executions of the route's capped operations.
    Count,
    /// Executions of one tool (an MCP tool, by name) alone.
    ToolCount(String),
}

/// Which budget a refusal is about, as the configuration names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CapName {
    PerRequest,
    PerRun,
    PerTenant,
    PerRoute,
    CountPerRun,
    CountPerTenant,
    CountPerRoute,
    ApproveRunAbove,
    ApproveTenantAbove,
}

impl CapName {
    /// Every name a refusal or a shadowed decision can carry (metrics' `cap` label).
    pub const ALL: [CapName; 9] = [
        CapName::PerRequest,
        CapName::PerRun,
        CapName::PerTenant,
        CapName::PerRoute,
        CapName::CountPerRun,
        CapName::CountPerTenant,
        CapName::CountPerRoute,
        CapName::ApproveRunAbove,
        CapName::ApproveTenantAbove,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            CapName::PerRequest => "per_request",
            CapName::PerRun => "per_run",
            CapName::PerTenant => "per_tenant",
            CapName::PerRoute => "per_route",
            CapName::CountPerRun => "count_per_run",
            CapName::CountPerTenant => "count_per_tenant",
            CapName::CountPerRoute => "count_per_route",
            CapName::ApproveRunAbove => "approve_run_above",
            CapName::ApproveTenantAbove => "approve_tenant_above",
        }
    }

    /// A cap on executions, not money.
    pub fn counts(self) -> bool {
        matches!(
            self,
            CapName::CountPerRun | CapName::CountPerTenant | CapName::CountPerRoute
        )
    }

    /// The configuration's name of a cap on `measure` over `over` (a tool's own count caps
    /// are named like the route-wide ones: `tools.NAME.count_per_run`).
    fn of(over: Over, measure: &Measure) -> CapName {
        match (measure, over) {
            (Measure::Money, Over::Run) => CapName::PerRun,
            (Measure::Money, Over::Tenant) => CapName::PerTenant,
            (Measure::Money, Over::Route) => CapName::PerRoute,
            (_, Over::Run) => CapName::CountPerRun,
            (_, Over::Tenant) => CapName::CountPerTenant,
            (_, Over::Route) => CapName::CountPerRoute,
        }
    }
}

/// How long spend counts against a cap: a rolling duration, or the calendar day (in the
/// route's time zone) the request is made in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Window {
    Rolling(Duration),
    CalendarDay,
}

impl Window {
    /// `calendar-day`, or a duration like `24h` or `30m`.
    pub fn parse(text: &str) -> Result<Window, String> {
        let t = text.trim();
        if t.eq_ignore_ascii_case("calendar-day") || t.eq_ignore_ascii_case("calendar_day") {
            return Ok(Window::CalendarDay);
        }
        match humantime::parse_duration(t) {
            Ok(d) if !d.is_zero() => Ok(Window::Rolling(d)),
            Ok(_) => Err("a window must be longer than 0".into()),
            Err(e) => Err(format!(
                "`{text}` is not a duration like 30m or 24h, nor \"calendar-day\": {e}"
            )),
        }
    }

    /// The longest this window spans: how long a reservation in it must be kept (a
    /// calendar day is 25 hours on the day clocks go back).
    pub fn longest(self) -> Duration {
        match self {
            Window::Rolling(d) => d,
            Window::CalendarDay => Duration::from_secs(25 * 3600),
        }
    }
}

/// What a tool's own execution counter's key holds before the tool's name.
pub const TOOL_COUNTER: &str = "/tool/";

/// Whose budgets a request counts against.
#[derive(Debug, Clone, Copy)]
pub struct Spender<'a> {
    pub route: &'a str,
    pub tenant: &'a str,
    pub run: &'a str,
}

impl Spender<'_> {
    // Every counter of a request but the route's shares the `{route/tenant}` hash tag, so a
    // Redis Cluster keeps them in one slot and one script can check them together.
    pub fn run_counter(&self) -> String {
        format!("{{{}/{}}}/run/{}", self.route, self.tenant, self.run)
    }

    pub fn tenant_counter(&self) -> String {
        format!("{{{}/{}}}/tenant", self.route, self.tenant)
    }

    /// Every tenant's spend on the route.
    pub fn route_counter(&self) -> String {
        format!("{{{}}}/route", self.route)
    }
}

/// The one place a counter's key in the store is written: the scope's money counter, its
/// `/executions` beside it, a tool's own `/executions/tool/NAME`. These are the keys every
/// earlier release wrote: a proxy of the previous release sharing the store counts the same.
pub fn counter_key(who: &Spender<'_>, over: Over, measure: &Measure) -> String {
    let scope = match over {
        Over::Run => who.run_counter(),
        Over::Tenant => who.tenant_counter(),
        Over::Route => who.route_counter(),
    };
    match measure {
        Measure::Money => scope,
        Measure::Count => format!("{scope}/executions"),
        Measure::ToolCount(tool) => format!("{scope}/executions{TOOL_COUNTER}{tool}"),
    }
}

/// One budget of a route.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cap {
    pub over: Over,
    pub measure: Measure,
    /// Minor units or executions; `None`: counted without a limit (a run's and a tenant's
    /// money are counted for every priced request, for thresholds and for people to read).
    pub limit: Option<i64>,
    /// Money over this scope above which a person approves (`approve_run_above`, …).
    pub approve_above: Option<i64>,
    pub window: Window,
    pub name: CapName,
}

impl Cap {
    pub fn key(&self, who: &Spender<'_>) -> String {
        counter_key(who, self.over, &self.measure)
    }

    /// The threshold's name, for a cap with one.
    pub fn approval_name(&self) -> CapName {
        match self.over {
            Over::Tenant => CapName::ApproveTenantAbove,
            _ => CapName::ApproveRunAbove,
        }
    }

    /// Whether a reservation for a request of `tool` (when it calls one), priced or not,
    /// counts on this cap.
    pub fn applies(&self, priced: bool, tool: Option<&str>) -> bool {
        match &self.measure {
            Measure::Money => priced,
            Measure::Count => true,
            Measure::ToolCount(t) => tool == Some(t.as_str()),
        }
    }

    /// Whether the cap limits anything (a limit or a threshold), rather than only counting.
    pub fn limits(&self) -> bool {
        self.limit.is_some() || self.approve_above.is_some()
    }

    /// For people: `` (money), `, executions`, `, executions of create_refund`.
    pub fn what(&self) -> String {
        match &self.measure {
            Measure::Money => String::new(),
            Measure::Count => ", executions".into(),
            Measure::ToolCount(t) => format!(", executions of {t}"),
        }
    }
}

/// The limits of one scope as configured: money, executions, a money threshold.
#[derive(Debug, Clone, Default)]
pub struct ScopeLimits {
    pub money: Option<i64>,
    pub count: Option<i64>,
    pub approve_above: Option<i64>,
}

/// Every budget of a route, in the order a reservation checks them: money over the run, the
/// tenant and the route, then executions over the same, then each tool's own executions
/// (by tool name).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Caps(Vec<Cap>);

impl Caps {
    /// `limits(over)`: what the section sets over `over`; `window(over)`: its window; `tools`:
    /// each tool's own count caps per scope.
    pub fn build(
        limits: impl Fn(Over) -> ScopeLimits,
        window: impl Fn(Over) -> Window,
        tools: &[(String, [Option<i64>; 3])],
    ) -> Caps {
        let mut caps = Vec::new();
        for over in Over::ALL {
            let l = limits(over);
            // A run's and a tenant's money are counted for every priced request, capped or
            // not (the stored layout every release has had); the route's only when capped.
            if l.money.is_some() || l.approve_above.is_some() || over != Over::Route {
                caps.push(Cap::new(
                    over,
                    Measure::Money,
                    l.money,
                    l.approve_above,
                    window(over),
                ));
            }
        }
        for over in Over::ALL {
            if let Some(n) = limits(over).count {
                caps.push(Cap::new(over, Measure::Count, Some(n), None, window(over)));
            }
        }
        for (tool, per) in tools {
            for (over, n) in Over::ALL.into_iter().zip(per) {
                if let Some(n) = n {
                    let m = Measure::ToolCount(tool.clone());
                    caps.push(Cap::new(over, m, Some(*n), None, window(over)));
                }
            }
        }
        Caps(caps)
    }

    pub fn iter(&self) -> impl Iterator<Item = &Cap> {
        self.0.iter()
    }

    /// The first cap of this name over all tools (route-wide before a tool's own).
    pub fn named(&self, name: CapName) -> Option<&Cap> {
        self.0.iter().find(|c| c.name == name)
    }

    /// The cap over `over` of `measure`.
    pub fn of(&self, over: Over, measure: &Measure) -> Option<&Cap> {
        self.0
            .iter()
            .find(|c| c.over == over && &c.measure == measure)
    }
}

impl Cap {
    fn new(
        over: Over,
        measure: Measure,
        limit: Option<i64>,
        approve_above: Option<i64>,
        window: Window,
    ) -> Cap {
        Cap {
            name: CapName::of(over, &measure),
            over,
            measure,
            limit,
            approve_above,
            window,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counter_keys_are_the_layout_earlier_releases_wrote() {
        let who = Spender {
            route: "pay",
            tenant: "acme",
            run: "r1",
        };
        let key = |o, m: Measure| counter_key(&who, o, &m);
        assert_eq!(key(Over::Run, Measure::Money), "{pay/acme}/run/r1");
        assert_eq!(key(Over::Tenant, Measure::Money), "{pay/acme}/tenant");
        assert_eq!(key(Over::Route, Measure::Money), "{pay}/route");
        assert_eq!(
            key(Over::Tenant, Measure::Count),
            "{pay/acme}/tenant/executions"
        );
        assert_eq!(
            key(Over::Run, Measure::ToolCount("create_refund".into())),
            "{pay/acme}/run/r1/executions/tool/create_refund"
        );
    }
}
