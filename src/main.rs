//! The `cachalot` command-line program (replay and compare land with the trace tooling).

fn main() {}
