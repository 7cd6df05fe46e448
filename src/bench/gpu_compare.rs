//! The program `gpu_compare` (`benches/gpu_compare.rs`): every ops file read and checked
//! before anything runs, then the trace runs, then the hot loops.

use std::sync::Arc;

use cachalot::cuda::cudarc::driver::CudaContext;

use super::allocators::{SIM_CAPACITY, cuda_context};
use super::error::{Failure, fail};
use super::hot::run_hot;
use super::options::{BackendKind, Options};
use super::traces::{Workload, run_traces};

/// Runs the benchmark as `options` say.
pub fn run(o: &Options) -> Result<(), Failure> {
    // Every file is read and checked before anything runs.
    let mut workloads: Vec<Workload> = Vec::new();
    if o.traces {
        for path in &o.ops {
            let w = Workload::read(path)?;
            if workloads.iter().any(|q| q.name == w.name) {
                return Err(Failure::Input(format!(
                    "{}: a second trace named {:?} (results are named by the file's stem)",
                    path.display(),
                    w.name
                )));
            }
            workloads.push(w);
        }
    }
    std::fs::create_dir_all(o.out.join("runs"))
        .map_err(|e| fail(&format!("creating {}", o.out.display()), e))?;
    let ctx: Option<Arc<CudaContext>> = match o.backend {
        BackendKind::Cuda => {
            let ctx = cuda_context()?;
            println!(
                "GPU: {}",
                ctx.name().unwrap_or_else(|_| "unknown GPU".into())
            );
            Some(ctx)
        }
        BackendKind::Sim => {
            let skipped: Vec<&str> = o
                .only
                .0
                .iter()
                .copied()
                .filter(|k| o.cachalot_settings(k).is_none())
                .collect();
            println!(
                "simulated device ({} GiB){}",
                SIM_CAPACITY >> 30,
                if skipped.is_empty() {
                    String::new()
                } else {
                    format!("; skipped (they need a GPU): {}", skipped.join(", "))
                }
            );
            None
        }
    };
    if o.traces {
        run_traces(o, &workloads, ctx.as_ref())?;
    }
    if o.hot {
        run_hot(o, ctx.as_ref())?;
    }
    Ok(())
}
