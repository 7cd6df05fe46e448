//! The command line's error type, which decides the exit code.

/// A failure that ends the program, with its exit code.
#[derive(Debug)]
pub struct CliError {
    /// 2 for bad input, 1 for failures while running, 3 for `cachalot fit`'s "does not fit".
    pub code: u8,
    /// What to print (after `cachalot: `).
    pub message: String,
}

impl CliError {
    /// Bad input: exit code 2.
    pub fn input(message: impl Into<String>) -> CliError {
        CliError {
            code: 2,
            message: message.into(),
        }
    }

    /// A failure while running: exit code 1.
    pub fn run(message: impl Into<String>) -> CliError {
        CliError {
            code: 1,
            message: message.into(),
        }
    }
}
