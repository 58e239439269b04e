//! cube-adapter: an appliance between AI coding agents and CubeSandbox.
//!
//! This library holds everything; `main.rs` only calls `cli::run`.

#![forbid(unsafe_code)]
#![deny(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing,
    clippy::await_holding_lock
)]
// Handlers return `Result<_, Response>` to short-circuit with a ready answer.
#![allow(clippy::result_large_err)]

pub mod admin;
pub mod api;
pub mod app;
pub mod audit;
pub mod auth;
pub mod bench;
pub mod broker;
pub mod cli;
pub(crate) mod clients;
pub mod clock;
pub mod config;
pub(crate) mod console;
pub mod cube;
/// The embedded backend (`crates/embedded`): its own crate, under the
/// name the appliance has always used for it.
pub use cube_embedded as embedded;
pub(crate) mod ids;
pub mod mcp;
pub(crate) mod metrics;
pub(crate) mod ops;
pub(crate) mod secrets;
pub mod server;
pub(crate) mod standalone;
pub mod store;
pub(crate) mod systemd;
pub(crate) mod telemetry;
pub mod tls;
