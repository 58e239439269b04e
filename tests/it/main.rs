//! The one integration-test binary: a module per area.
//!
//! Every test starts the real server in-process on 127.0.0.1:0 and talks to
//! it over the wire; sandboxes are real namespaced process trees.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod abuse;
mod appliance;
mod backends;
mod client_ca;
mod config_import;
mod connect;
mod connections;
mod console;
mod crash;
mod cube_client;
mod egress;
mod egress_tap;
mod embedded;
mod escape;
mod export;
mod governed_mcp;
mod hosts;
mod identities;
mod jobs;
mod kit;
mod layers;
mod mcp;
mod mcp_gateway;
mod metrics;
mod mounts;
mod network;
mod oidc;
mod pg_conn;
mod presets;
mod production;
mod ptys;
mod recordings;
mod replicas;
mod rollback_race;
mod sdk;
mod service;
mod sinks;
mod spec;
mod tasks;
mod upkeep;
mod volumes;
