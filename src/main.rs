//! The `cachalot` command-line program: replay PyTorch memory snapshots through cachalot's
//! caching allocator (`cachalot replay`) and compare allocator settings on them
//! (`cachalot compare`). Run `cachalot --help` for the options.

fn main() -> std::process::ExitCode {
    std::process::ExitCode::from(cachalot_tools::run_cli(std::env::args_os()))
}
