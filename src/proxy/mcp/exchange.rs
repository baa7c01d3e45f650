//! One protected tool call's exchange with the server, under its claim: the call the claim's
//! task runs (`prepare`), and the server's answer passed to the client (`answer`: an event
//! stream as it comes, a JSON body once settled) while the same bytes are read for the call's
//! final response, which is what the claim keeps.

use std::sync::Arc;

use bytes::Bytes;
use futures_util::StreamExt as _;
use http::{header, HeaderValue, Request, Response, StatusCode};
use http_body_util::{BodyExt as _, StreamBody};
use hyper::body::Frame;
use serde_json::Value;
use tokio::sync::{mpsc, oneshot};

use super::content_type;
use super::deadline::Deadline;
use crate::http::body::{full, read_limited, Body, BoxError};
use crate::http::headers::strip_hop_by_hop;
use crate::idempotency::claims::Executed;
use crate::idempotency::record::Receipt;
use crate::mcp::{replay, sse};
use crate::metrics::RequestOutcome;
use crate::outbound::receipt::REPLAYED;
use crate::outbound::upstream::{Upstream, UpstreamBody, UpstreamError};
use crate::proxy::admission::Admitted;
use crate::proxy::error::ProxyError;
use crate::proxy::operation::{Call, Settling};
use crate::proxy::App;
use crate::routes::Route;

/// Live events buffered toward a slow client before the upstream read waits for it.
const LIVE_EVENTS: usize = 64;

/// Where the exchange hands the server's answer to the client's side: its head, an event
/// stream's bytes as they come, or a JSON body read whole.
struct Toward {
    head: oneshot::Sender<Head>,
    live: mpsc::Sender<Bytes>,
    whole: oneshot::Sender<(http::response::Parts, Bytes)>,
}

/// The call's JSON-RPC id, and where its result is awaited if its stream closes before it
/// (`mcp::resume`; `None` without a session).
pub(super) struct Answering {
    pub id: Value,
    pub resume: Option<String>,
    /// The MCP endpoint the call goes to (`probe::endpoint`): a `list_changed` in its stream
    /// forgets that endpoint's annotations.
    pub endpoint: String,
}

/// How the server's answer reaches the client, once its head is in.
enum Head {
    /// A JSON body (or an HTTP error), read whole: answered once the claim is settled.
    Whole,
    /// An event stream: answered at once, its events as they come.
    Streaming(http::response::Parts),
}

/// The client's side of an exchange: where the call hands over the server's answer.
pub(super) struct ClientSide {
    head: oneshot::Receiver<Head>,
    live: mpsc::Receiver<Bytes>,
    whole: oneshot::Receiver<(http::response::Parts, Bytes)>,
}

/// The call a protected tool call makes under its claim (run in the claim's own task by the
/// driver), and where its answer will reach the client.
pub(super) fn prepare(
    app: &App,
    route: &Arc<Route>,
    request: Request<Body>,
    admitted: Option<Admitted>,
    answering: Answering,
) -> (Call, ClientSide) {
    let Answering {
        id,
        resume,
        endpoint,
    } = answering;
    let (head, head_rx) = oneshot::channel();
    let (live, live_rx) = mpsc::channel::<Bytes>(LIVE_EVENTS);
    let (whole, whole_rx) = oneshot::channel();
    let toward = Toward { head, live, whole };
    let client = route.client.clone();
    let (timeout, max) = (route.timeout, app.max_receipt_bytes);
    let answer_timeout = route
        .mcp
        .as_ref()
        .map_or(crate::mcp::DEFAULT_ANSWER_TIMEOUT, |r| r.answer_timeout);
    let route_held = route.clone();
    let call = Box::pin(async move {
        let _admitted = admitted;
        let list_changed = || {
            if let Some(rules) = &route_held.mcp {
                rules.annotations.forget(&endpoint);
            }
        };
        let resume = route_held
            .mcp
            .as_ref()
            .zip(resume.as_deref())
            .and_then(|(rules, key)| rules.resumptions.wait(key));
        let deadline = Deadline::new(timeout, answer_timeout);
        let exchange = call(
            client.as_ref(),
            request,
            &id,
            max,
            toward,
            Watching {
                list_changed: &list_changed,
                deadline: &deadline,
            },
            resume,
        );
        deadline
            .run(exchange)
            .await
            .unwrap_or(Err(UpstreamError::Timeout(timeout)))
    });
    let waiting = ClientSide {
        head: head_rx,
        live: live_rx,
        whole: whole_rx,
    };
    (call, waiting)
}

/// The answer to an executing call: an event stream at once (settled in the background), or
/// the JSON body once the claim is settled. Returns it and what became of the claim.
pub(super) async fn answer(
    waiting: ClientSide,
    settling: Settling,
) -> (Result<Response<Body>, ProxyError>, RequestOutcome) {
    let ClientSide { head, live, whole } = waiting;
    if let Ok(Head::Streaming(mut parts)) = head.await {
        strip_hop_by_hop(&mut parts.headers);
        parts.headers.remove(header::CONTENT_LENGTH);
        parts
            .headers
            .insert(REPLAYED, HeaderValue::from_static("false"));
        let events = tokio_stream_of(live);
        let body: Body = http_body_util::BodyExt::boxed(StreamBody::new(events));
        // Settled in the background: the stream's last event arrives before the settle.
        return (
            Ok(Response::from_parts(parts, body)),
            RequestOutcome::Forwarded,
        );
    }
    let executed = match settling.settled().await {
        Ok(executed) => executed,
        Err(e) => return (Err(e), RequestOutcome::Unknown),
    };
    let outcome = outcome_of(&executed);
    let whole = whole.await.ok();
    let Executed {
        result,
        outcome: o,
        recorded,
    } = executed;
    match (result, whole) {
        (Ok(_), Some((parts, body))) => {
            let mut resp = Response::from_parts(parts, full(body));
            strip_hop_by_hop(resp.headers_mut());
            resp.headers_mut()
                .insert(REPLAYED, HeaderValue::from_static("false"));
            (Ok(resp), outcome)
        }
        (Ok(receipt), None) => (
            Ok(crate::outbound::receipt::respond(&receipt, false)),
            outcome,
        ),
        (Err(error), _) => (
            Err(ProxyError::Upstream {
                error,
                claim: Some((o, recorded)),
            }),
            outcome,
        ),
    }
}

fn outcome_of(executed: &Executed<UpstreamError>) -> RequestOutcome {
    use crate::idempotency::claims::Recorded;
    use crate::idempotency::outcome::Outcome;
    match (&executed.outcome, executed.recorded) {
        (_, Recorded::NotOurs | Recorded::Unconfirmed) => RequestOutcome::Unknown,
        (Outcome::Committed | Outcome::Declined, _) => RequestOutcome::Forwarded,
        (Outcome::Released | Outcome::Awaiting(_), _) => RequestOutcome::Released,
        (Outcome::Unknown(_) | Outcome::Duplicate(_), _) => RequestOutcome::Unknown,
    }
}

fn tokio_stream_of(
    rx: mpsc::Receiver<Bytes>,
) -> impl futures_util::Stream<Item = Result<Frame<Bytes>, BoxError>> + Send + Sync + 'static {
    futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|b| (Ok(Frame::data(b)), rx))
    })
}

/// One upstream exchange for a tool call. The head goes to `head` as soon as it is known: an
/// event stream's events go to `live` as they arrive while the call's final response is
/// looked for; a JSON body is read whole and handed over through `whole`. The receipt is the
/// final JSON-RPC message (HTTP 200), or the server's HTTP answer when it is not a success.
async fn call(
    client: &dyn Upstream,
    request: Request<Body>,
    id: &Value,
    max: usize,
    toward: Toward,
    watching: Watching<'_>,
    resumed: Option<oneshot::Receiver<Vec<u8>>>,
) -> Result<Receipt, UpstreamError> {
    let Toward { head, live, whole } = toward;
    let resp = client.send(request).await?;
    let (parts, body) = resp.into_parts();
    let framing = content_type(&parts.headers);
    if parts.status.is_success() && framing == replay::SSE {
        let _ = head.send(Head::Streaming(parts));
        let on_stream = follow_stream(body, id, max, live, watching).await;
        return match (on_stream, resumed) {
            (Ok(Followed::Result(receipt)), _) => Ok(receipt),
            // Closed after an event the server stored: the client resumes with a GET, and the
            // result arriving there settles the call (within the route's timeout).
            (Ok(Followed::Closed { resumable: true }), Some(rx)) => match rx.await {
                Ok(message) => Ok(kept(Bytes::from(message), replay::SSE)),
                Err(_) => Err(ended_early()),
            },
            (Ok(Followed::Closed { .. }), _) => Err(ended_early()),
            (Err(e), _) => Err(e),
        };
    }
    let _ = head.send(Head::Whole);
    let bytes = read_limited(body, max).await?;
    let receipt = if parts.status.is_success() {
        match serde_json::from_slice::<Value>(&bytes) {
            Ok(m) if replay::answers(&m, id) => kept(bytes.clone(), replay::JSON),
            // A success that is not the call's answer: it may have run; never a receipt.
            _ => not_an_answer(),
        }
    } else {
        crate::outbound::receipt::from_response(&parts, bytes.clone())
    };
    let _ = whole.send((parts, bytes));
    Ok(receipt)
}

/// Reads an event stream to the call's final response, passing every byte on as it comes.
/// The client going away stops nothing: the stream is read on, to settle the claim.
async fn follow_stream(
    body: UpstreamBody,
    id: &Value,
    max: usize,
    live: mpsc::Sender<Bytes>,
    watching: Watching<'_>,
) -> Result<Followed, UpstreamError> {
    let mut reader = sse::Reader::default();
    let mut resumable = false;
    let mut frames = body.into_data_stream();
    let mut read = 0usize;
    while let Some(chunk) = frames.next().await {
        let chunk =
            chunk.map_err(|e| UpstreamError::Failed(format!("the event stream broke: {e}")))?;
        read += chunk.len();
        if read > max {
            return Err(UpstreamError::ResponseTooLarge(max));
        }
        let events = reader.feed(&chunk);
        // A client that went away no longer gets the events; the reading goes on.
        if !live.is_closed() {
            let _ = live.send(chunk).await;
        }
        for event in events {
            resumable |= event.id.is_some();
            let Ok(message) = serde_json::from_str::<Value>(&event.data) else {
                continue;
            };
            let method = message.get("method").and_then(Value::as_str);
            if method == Some("notifications/tools/list_changed") {
                (watching.list_changed)();
            }
            // A server request (elicitation, sampling) waits for the client's answer, often a
            // person's; anything after it means the server moved on.
            if method.is_some() && message.get("id").is_some() {
                watching.deadline.asked();
            } else {
                watching.deadline.moved_on();
            }
            if replay::answers(&message, id) {
                return Ok(Followed::Result(kept(
                    Bytes::from(event.data.into_bytes()),
                    replay::SSE,
                )));
            }
        }
    }
    Ok(Followed::Closed { resumable })
}

/// What reading a call's stream looks out for besides its result.
#[derive(Clone, Copy)]
struct Watching<'a> {
    /// The server's tool list changed: forget what it said.
    list_changed: &'a (dyn Fn() + Send + Sync),
    /// Server requests waiting for an answer stretch the call's deadline.
    deadline: &'a Deadline,
}

/// Where a call's event stream left it.
enum Followed {
    /// Its final response.
    Result(Receipt),
    /// Closed before it; `resumable` when the server numbered its events (it stored them,
    /// and the client may resume).
    Closed { resumable: bool },
}

fn ended_early() -> UpstreamError {
    UpstreamError::Failed("the event stream ended before the call's result".into())
}

/// A final response as kept: status 200, its framing, the message.
fn kept(message: Bytes, framing: &str) -> Receipt {
    Receipt {
        status: 200,
        headers: vec![("content-type".into(), framing.into())],
        body: message,
    }
}

/// What a success that does not answer the call is classified as: held, like a 502.
fn not_an_answer() -> Receipt {
    Receipt {
        status: StatusCode::BAD_GATEWAY.as_u16(),
        headers: vec![("content-type".into(), replay::JSON.into())],
        body: Bytes::from_static(b"{}"),
    }
}
