//! What holds the memory at a moment of a replay: the live tensors grouped by where they were
//! allocated, the memory reserved but free (what `empty_cache()` would give back, what is
//! stranded in split segments), and the advice the figures support, each backed by a replay.
//!
//! - `moment`: the survey that finds the moment and the breakdown there ([`explain()`],
//!   [`Breakdown`]);
//! - [`stacks`]: allocation stacks told for people;
//! - [`advice`]: the advice, each backed by a replay;
//! - [`html`]: the self-contained page.

pub mod advice;
pub mod html;
pub(crate) mod moment;
pub mod stacks;

pub use advice::{Advice, advise};
pub use moment::{At, Breakdown, FreeBySize, Group, Survey, breakdown, explain, survey};
pub use stacks::{Origin, PyFrame, StackSummary, frame_lines, origins, summarize};
