//! What CONNECT may reach, decided from the config and the routes alone: the settings built
//! at start-up, the target a CONNECT names and its refusals, and the other ways to a
//! protected provider than its routed host (its addresses under another name, its SMTP
//! relays). It serves nothing itself, so the proxy's state can hold it without depending on
//! the tunnels and interception that use it (`proxy::connect`).

pub mod policy;
pub mod side_doors;

pub use self::policy::{summary, ConnectError, ConnectPolicy, ConnectTarget};
