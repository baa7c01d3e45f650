//! idemproxy: an HTTP(S) proxy that lets each protected request reach its provider at most
//! once per idempotency key, and answers every retry with the provider's real first response.

pub mod admin;
pub mod app;
pub mod auth;
pub mod config;
pub mod demo;
pub mod hex;
pub mod http;
pub mod idempotency;
pub mod identity;
pub mod mcp;
pub mod metrics;
pub mod providers;
pub mod proxy;
pub mod reload;
pub mod request;
pub mod routes;
pub mod spend;
pub mod store;
pub mod tls;
