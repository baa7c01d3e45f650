//! Redis auto-pipelining: the claim and settle commands that requests issue in the same pass
//! of the scheduler travel to Redis in one write and come back in one read.
//!
//! Why: on loopback every socket write runs the whole TCP path, including the receiver's,
//! and profiles showed the two per-request writes to Redis costing more than the commands
//! themselves. Redis executes a pipeline's commands one by one in order, so batching changes
//! no command's meaning; each caller still gets its own command's reply (or error).
//!
//! The queue is drained after one `yield_now`: the scheduler runs every task that is ready
//! before it resumes us, so everything issued in this pass joins the batch, and a lone
//! command waits no longer than one pass.
//!
//! With `WAIT` acknowledgement on, a batch holding writes ends with one `WAIT n timeout`:
//! Redis answers it once `n` replicas have every write this connection sent before it, so one
//! `WAIT` covers the whole batch. Short of `n`, each command of the batch that did write
//! fails (it ran on the master, but a failover could lose it); reads, and writes whose reply
//! says they changed nothing (a claim that found a record, a fence that did not admit),
//! keep their replies.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures_util::stream::{FuturesUnordered, StreamExt as _};
use redis::aio::{ConnectionLike as _, ConnectionManager};
use redis::{Cmd, RedisError, RedisResult, Value};
use tokio::sync::{mpsc, oneshot};

/// Largest batch; a bigger backlog goes out in several writes.
const MAX_BATCH: usize = 256;

struct Queued {
    cmd: Cmd,
    effect: Effect,
    reply: oneshot::Sender<RedisResult<Value>>,
}

/// What a command's reply says about whether it wrote: what `WAIT` must see replicated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Effect {
    Read,
    /// `SET … NX GET`: wrote when it answers nil (nothing was there).
    WroteIfNil,
    /// The fenced scripts: wrote when they answer 1.
    WroteIfOne,
    /// May have written, whatever it answers (spend reservations).
    Wrote,
}

impl Effect {
    pub fn wrote(self, reply: &Value) -> bool {
        match self {
            Effect::Read => false,
            Effect::WroteIfNil => matches!(reply, Value::Nil),
            Effect::WroteIfOne => matches!(reply, Value::Int(1)),
            Effect::Wrote => true,
        }
    }
}

/// The error of a write that `WAIT` found short of replicas (recognised by its text).
pub const NOT_REPLICATED: &str = "not acknowledged by enough replicas";

/// Where batches go: the connection to use now (a Sentinel setup changes it on failover).
pub trait Connections: Send + Sync + 'static {
    fn current(&self) -> RedisResult<ConnectionManager>;
}

/// `WAIT` acknowledgement: writes count once this many replicas have them.
#[derive(Debug, Clone, Copy)]
pub struct Wait {
    pub replicas: u32,
    pub timeout: Duration,
}

impl Wait {
    pub fn command(self) -> Cmd {
        let mut cmd = redis::cmd("WAIT");
        cmd.arg(self.replicas).arg(self.timeout.as_millis() as u64);
        cmd
    }

    /// `WAIT`'s reply: the replicas that acknowledged, enough or an error for the writes.
    pub fn check(self, reply: &Value) -> RedisResult<()> {
        match reply {
            Value::Int(n) if *n >= i64::from(self.replicas) => Ok(()),
            Value::Int(n) => Err(RedisError::from(std::io::Error::other(format!(
                "{NOT_REPLICATED}: only {n} of {} replicas had the write within {:?}",
                self.replicas, self.timeout
            )))),
            other => Err(RedisError::from(std::io::Error::other(format!(
                "WAIT answered {other:?}"
            )))),
        }
    }
}

#[derive(Clone)]
pub struct AutoPipeline {
    queue: mpsc::UnboundedSender<Queued>,
}

impl AutoPipeline {
    /// Starts the batching task on the current runtime; it ends when every handle is dropped.
    pub fn start(conns: Arc<dyn Connections>, wait: Option<Wait>) -> AutoPipeline {
        let (queue, rx) = mpsc::unbounded_channel();
        tokio::spawn(run(rx, conns, wait));
        AutoPipeline { queue }
    }

    /// Sends `cmd` with the next batch and returns its own reply.
    pub async fn query(&self, cmd: Cmd, effect: Effect) -> RedisResult<Value> {
        let (reply, answer) = oneshot::channel();
        self.queue
            .send(Queued { cmd, effect, reply })
            .map_err(|_| stopped())?;
        answer.await.unwrap_or_else(|_| Err(stopped()))
    }
}

fn stopped() -> RedisError {
    RedisError::from(std::io::Error::new(
        std::io::ErrorKind::BrokenPipe,
        "the Redis pipeline task stopped",
    ))
}

type InFlight = Pin<Box<dyn Future<Output = ()> + Send>>;

async fn run(
    mut rx: mpsc::UnboundedReceiver<Queued>,
    conns: Arc<dyn Connections>,
    wait: Option<Wait>,
) {
    // Batches already written whose replies are pending: the next batch does not wait for them.
    let mut in_flight: FuturesUnordered<InFlight> = FuturesUnordered::new();
    loop {
        let first = tokio::select! {
            queued = rx.recv() => match queued {
                Some(q) => q,
                None => break,
            },
            Some(()) = in_flight.next(), if !in_flight.is_empty() => continue,
        };
        tokio::task::yield_now().await;
        let mut batch = vec![first];
        while batch.len() < MAX_BATCH {
            match rx.try_recv() {
                Ok(q) => batch.push(q),
                Err(_) => break,
            }
        }
        // A caller that went away (its timeout, a dropped request) needs no reply; its
        // command is not sent at all if it has not been yet.
        batch.retain(|q| !q.reply.is_closed());
        if batch.is_empty() {
            continue;
        }
        match conns.current() {
            Ok(conn) => in_flight.push(Box::pin(send(conn, batch, wait))),
            Err(e) => {
                for q in batch {
                    let _ = q.reply.send(Err(e.clone()));
                }
            }
        }
    }
    while in_flight.next().await.is_some() {}
}

async fn send(mut conn: ConnectionManager, mut batch: Vec<Queued>, wait: Option<Wait>) {
    let wait = wait.filter(|_| batch.iter().any(|q| q.effect != Effect::Read));
    if batch.len() == 1 && wait.is_none() {
        if let Some(q) = batch.pop() {
            let result = conn.req_packed_command(&q.cmd).await.and_then(server_error);
            let _ = q.reply.send(result);
        }
        return;
    }
    let mut pipe = redis::pipe();
    let mut replies = Vec::with_capacity(batch.len());
    for q in batch {
        pipe.add_command(q.cmd);
        replies.push((q.reply, q.effect));
    }
    if let Some(wait) = wait {
        pipe.add_command(wait.command());
    }
    pipe.ignore_errors();
    let expected = replies.len() + usize::from(wait.is_some());
    match pipe.query_async::<Vec<Value>>(&mut conn).await {
        Ok(mut values) if values.len() == expected => {
            let acknowledged = match (wait, values.len() > replies.len()) {
                (Some(wait), true) => values.pop().map_or(Ok(()), |v| wait.check(&v)),
                _ => Ok(()),
            };
            for ((reply, effect), value) in replies.into_iter().zip(values) {
                let result = match &acknowledged {
                    Err(e) if effect.wrote(&value) => Err(e.clone()),
                    _ => server_error(value),
                };
                let _ = reply.send(result);
            }
        }
        Ok(values) => {
            let e = RedisError::from(std::io::Error::other(format!(
                "Redis answered {} replies to a pipeline of {expected}",
                values.len(),
            )));
            for (reply, _) in replies {
                let _ = reply.send(Err(e.clone()));
            }
        }
        Err(e) => {
            for (reply, _) in replies {
                let _ = reply.send(Err(e.clone()));
            }
        }
    }
}

/// A command's error reply (NOSCRIPT, WRONGTYPE, …) as its error, as a lone command's would be.
pub fn server_error(value: Value) -> RedisResult<Value> {
    match value {
        Value::ServerError(e) => Err(RedisError::from(e)),
        v => Ok(v),
    }
}
