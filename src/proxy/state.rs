//! Everything a request needs, built once at start-up (by `crate::app`) and shared by every
//! connection: the proxy's runtime state.

use std::sync::Arc;

use super::admission::ForwardLimit;
use super::egress_policy::ConnectPolicy;
use crate::auth::Tenants;
use crate::idempotency::claims::Claims;
use crate::identity::minted_keys::MintedKeys;
use crate::metrics::Metrics;
use crate::outbound::egress::Egress;
use crate::outbound::upstream::UpstreamClient;
use crate::routes::RouteTable;
use crate::spend::gate::Gate;

pub struct App {
    /// Replaced whole by a config reload (`crate::reload`).
    pub routes: RouteTable,
    pub claims: Arc<Claims>,
    pub namespace: String,
    pub max_body_bytes: usize,
    pub max_receipt_bytes: usize,
    /// For forward-proxy requests to hosts no route covers.
    pub default_client: UpstreamClient,
    /// CONNECT: allowed ports, unknown hosts, and the CA for interception.
    pub connect: ConnectPolicy,
    pub metrics: Arc<Metrics>,
    pub tenants: Tenants,
    /// Where requests no route covers may go.
    pub egress: Arc<Egress>,
    /// Bounds on protected requests being forwarded.
    pub admission: ForwardLimit,
    pub minted_keys: MintedKeys,
    /// Caps and approvals for the routes with `[routes.spend]`.
    pub spend: Arc<Gate>,
}
