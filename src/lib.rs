//! idemproxy: an HTTP(S) proxy that lets each protected request reach its provider at most
//! once per idempotency key, and answers every retry with the provider's real first response.
//!
//! # Layout
//!
//! From the top down: a module imports only modules on its own line or below it, never one
//! above (`docs/whiteboard.json` holds the rules; `docs/architecture.md` walks a request).
//!
//! - [`serve`]: the proxy started from its config — built, listening, serving. The binary
//!   runs it; so does the in-process test tier.
//! - [`reload`], [`app`]: re-reading the config file; the wiring that builds everything the
//!   proxy runs on from a config (`app::Parts::check` is also `check-config`).
//! - [`admin`]: the admin listener — key API, approvals, console, metrics — and its CLI.
//! - [`proxy`]: the inbound side — listener, dispatch, CONNECT (`proxy::connect`),
//!   passthrough, and the pipeline of one protected request (`proxy::pipeline`), which only
//!   sequences the stages below.
//! - [`routes`]: the route table built from the config: what each route protects and how.
//! - [`outbound`]: the outbound side — upstream client, egress rules, TLS advice, receipts,
//!   lookups at the provider, the approvals webhook. [`store`]: SQLite, Redis and PostgreSQL
//!   behind one guard, implementing the ports of `idempotency` and `spend`. [`auth`]:
//!   tenants. [`providers`]: provider profiles.
//! - [`config`]: the TOML schema, data only.
//! - [`spend`]: costs, budgets, approvals. [`identity`]: who asks for what — accounts,
//!   operations, scopes, provider keys. [`demo`]: the demo's stand-in providers.
//! - [`idempotency`]: the claim state machine, records, its store port. [`request`]: one
//!   reader of requests. [`worker`]: `idemproxy env`, the setup that sends workers' SDKs
//!   through the proxy.
//! - [`http`], [`tls`], [`metrics`], [`hex`]: leaves every layer may use.

pub mod admin;
pub mod app;
pub mod auth;
pub mod config;
pub mod demo;
pub mod hex;
pub mod http;
pub mod idempotency;
pub mod identity;
pub mod log_writer;
pub mod mcp;
pub mod metrics;
pub mod outbound;
pub mod providers;
pub mod proxy;
pub mod redact;
pub mod reload;
pub mod request;
pub mod routes;
pub mod serve;
pub mod spend;
pub mod store;
pub mod tls;
pub mod worker;
