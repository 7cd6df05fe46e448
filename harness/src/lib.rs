//! `cachalot-harness`: where the allocator (`cachalot`) and its reference model
//! (`cachalot-model`) meet. Unpublished; only tests and fuzz targets depend on it.
//!
//! - [`op`]: the operations and how they are drawn (one table of weights), [`scenario`]: the
//!   settings a scenario varies ([`scenario::Knobs`], one table of choices), [`draw`]: how
//!   both feed proptest and cargo-fuzz alike.
//! - [`side`]: the [`side::Side`] trait and its three implementations — the allocator core,
//!   the thread-safe front end on worker threads, the model. Every call into the two crates
//!   is there.
//! - [`driver`]: the one interpreter of operations, applying each to two sides and comparing
//!   everything observable; it also takes the product's replay interpreter's calls, so that
//!   recorded traces run through the model too ([`replay`]).
//! - [`fuzzing`]: what each cargo-fuzz target of `fuzz/` runs.

pub mod draw;
pub mod driver;
pub mod fixtures;
pub mod fuzzing;
pub mod op;
pub mod replay;
pub mod scenario;
pub mod side;
