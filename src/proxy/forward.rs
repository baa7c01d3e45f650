//! The forward stage: what goes to a provider under a claim (the call the claim's own task
//! runs, `operation`), or without a claim, marked unprotected — the one unprotected forward. Between the claim and
//! the forward the claim is `Unsent`: withdrawn if the request goes away.

use std::sync::Arc;
use std::time::Instant;

use http::{Request, Response};

use super::admission::Admitted;
use super::answer;
use super::outgoing::Outgoing;
use crate::http::body::{stream, Body};
use crate::http::headers::strip_hop_by_hop;
use crate::idempotency::claims::{Claim, Claims};
use crate::idempotency::policy::Policy;
use crate::idempotency::record::Receipt;
use crate::metrics::InFlight;
use crate::outbound::upstream;
use crate::proxy::error::ProxyError;
use crate::proxy::App;
use crate::routes::Route;

/// A claim taken but not yet forwarded: withdrawn if the request goes away before it is (a
/// client that hangs up while the gate checks its budget must not leave a claim to lapse
/// into a held outcome).
pub(super) struct Unsent {
    pub(super) claims: Arc<Claims>,
    pub(super) policy: Arc<Policy>,
    pub(super) claim: Option<Claim>,
}

impl Unsent {
    pub(super) fn forward(mut self) -> Option<Claim> {
        self.claim.take()
    }

    pub(super) async fn withdraw(mut self) {
        if let Some(claim) = self.claim.take() {
            self.claims.give_up(claim, self.policy.clone()).await;
        }
    }
}

impl Drop for Unsent {
    fn drop(&mut self) {
        if let (Some(claim), Ok(rt)) = (self.claim.take(), tokio::runtime::Handle::try_current()) {
            let (claims, policy) = (self.claims.clone(), self.policy.clone());
            rt.spawn(async move {
                claims.give_up(claim, policy).await;
            });
        }
    }
}

/// The provider call one attempt makes, run in the claim's own task (`operation`).
pub(super) type Call =
    futures_util::future::BoxFuture<'static, Result<Receipt, upstream::UpstreamError>>;

/// The provider call of a request forwarded under its claim, read whole as a receipt within
/// the route's deadline; the forward slot is held until it ends, also when the client went
/// away before it. Boxed once here: the call would otherwise be part of the pipeline's future
/// and be copied with every move on its way into the claim's task.
pub(super) fn provider_call(
    app: &App,
    route: &Arc<Route>,
    request: Request<Body>,
    admitted: Option<Admitted>,
) -> Call {
    let (route_name, metrics) = (route.name.clone(), app.metrics.clone());
    let (client, deadline, max_receipt) =
        (route.client.clone(), route.timeout, app.max_receipt_bytes);
    Box::pin(async move {
        let _admitted = admitted;
        let _in_flight = InFlight::start(&metrics);
        let started = Instant::now();
        let result = upstream::call(&*client, request, deadline, max_receipt).await;
        metrics.upstream(&route_name, started.elapsed().as_secs_f64());
        result
    })
}

/// A protected request forwarded without protection (`why`), under `key` if any: its body
/// was read already, so it goes down buffered; the response streams back, marked with why it
/// was not protected.
pub(super) async fn unprotected(
    route: &Route,
    outgoing: &Outgoing<'_>,
    key: Option<&str>,
    why: &str,
) -> Result<Response<Body>, ProxyError> {
    match route.client.send(outgoing.request(key)).await {
        Ok(resp) => {
            let (mut parts, body) = resp.into_parts();
            strip_hop_by_hop(&mut parts.headers);
            answer::unprotected(&mut parts.headers, why);
            Ok(Response::from_parts(parts, stream(body)))
        }
        Err(error) => Err(ProxyError::Upstream { error, claim: None }),
    }
}
