//! The forward stage: a request goes to its provider under its claim, settled by the claim's
//! own task (`Claims::execute`), or without a claim, marked unprotected. Between the claim and
//! the forward the claim is `Unsent`: withdrawn if the request goes away.

use std::sync::Arc;
use std::time::Instant;

use http::{Request, Response};

use super::admission::Admitted;
use super::answer;
use super::outgoing::Outgoing;
use super::trace::Trace;
use crate::http::body::{stream, Body};
use crate::http::headers::strip_hop_by_hop;
use crate::idempotency::claims::{Claim, Claims, Executed, Recorded};
use crate::idempotency::outcome::Outcome;
use crate::idempotency::policy::Policy;
use crate::metrics::InFlight;
use crate::outbound::upstream::{self, UpstreamError};
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

/// Forwards under the claim and settles it (`Claims::execute`); the trace gets how long that
/// took and how it settled.
pub(super) async fn under_claim(
    app: &App,
    route: &Arc<Route>,
    claim: Claim,
    policy: Arc<Policy>,
    request: Request<Body>,
    admitted: Admitted,
    trace: &mut Trace,
) -> Result<Executed<UpstreamError>, ProxyError> {
    let forward_started = Instant::now();
    let (route_name, metrics) = (route.name.clone(), app.metrics.clone());
    let (client, deadline, max_receipt) =
        (route.client.clone(), route.timeout, app.max_receipt_bytes);
    // Boxed once here: the call (a provider request's whole future) would otherwise be part of
    // the pipeline's future and be copied again with every move on its way into its task.
    let call = Box::pin(async move {
        // Held until the call ends, also when the client went away before it.
        let _admitted = admitted;
        let _in_flight = InFlight::start(&metrics);
        let started = Instant::now();
        let result = upstream::call(&*client, request, deadline, max_receipt).await;
        metrics.upstream(&route_name, started.elapsed().as_secs_f64());
        result
    });
    let executed =
        app.claims
            .execute(claim, policy, call)
            .await
            .map_err(|e| ProxyError::Upstream {
                error: UpstreamError::Failed(format!("the forwarding task stopped: {e}")),
                claim: Some((Outcome::Released, Recorded::Unconfirmed)),
            })?;
    trace.forward = Some(forward_started.elapsed());
    trace.settled(&executed);
    Ok(executed)
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
