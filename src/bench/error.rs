//! Why the benchmark program stops.

/// Why `gpu_compare` stops (a bad command line is clap's to report, with the usage).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Failure {
    /// A bad ops file (exit code 2).
    Input(String),
    /// A failure while running: a driver or allocator error other than out of memory, or
    /// writing the results (exit code 1).
    Run(String),
}

impl Failure {
    /// The process's exit code.
    pub fn exit_code(&self) -> u8 {
        match self {
            Failure::Input(_) => 2,
            Failure::Run(_) => 1,
        }
    }
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Failure::Input(m) | Failure::Run(m) => f.write_str(m),
        }
    }
}

impl std::error::Error for Failure {}

/// A failure while running.
pub fn run_err(what: impl std::fmt::Display) -> Failure {
    Failure::Run(what.to_string())
}

/// A failure while running, of `what`.
pub fn fail(what: &str, e: impl std::fmt::Display) -> Failure {
    run_err(format!("{what}: {e}"))
}
