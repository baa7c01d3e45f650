//! Every integration test in one binary, so the harness (`common`) compiles once. Each
//! module is one suite; `scripts/test.sh` runs them all, `cargo test --test it <suite>::`
//! one of them.

#[macro_use]
mod common;

mod chaos;
mod console;
mod console_browser;
mod console_sessions;
mod console_webdriver;
mod core;
mod deploy_files;
mod derived_keys;
mod faults;
mod first_five;
mod https;
mod identity;
mod image;
mod mcp;
mod mcp_clients;
mod mcp_conformance;
mod mcp_gateway;
mod mcp_stripe;
mod money;
mod ops;
mod parked_payments;
mod postgres_store;
mod principals;
mod provider_hosts;
mod providers;
mod readme;
mod reconcile;
mod redaction;
mod redis_topologies;
mod request_reader;
mod sdk_examples;
mod sdk_matrix;
mod shared_redis;
mod side_doors;
mod signed_providers;
mod spend;
mod spend_chaos;
mod spend_gate;
mod store_conformance;
mod stripe_sdk;
mod upgrade;
mod x402;
