//! The `cachalot` command-line program: replay PyTorch memory snapshots through cachalot's
//! caching allocator (`cachalot replay`) and compare allocator settings on them
//! (`cachalot compare`). Run `cachalot --help` for the options.

mod cli;

fn main() -> std::process::ExitCode {
    cli::main()
}
