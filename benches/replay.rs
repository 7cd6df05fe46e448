//! Replay speed, steady state: every committed trace (`tests/fixtures/traces/*.pickle`)
//! replayed through `CachingCore` on the simulated device under PyTorch's settings plus the
//! configuration it was recorded with, as `cachalot replay --pytorch` does. BENCHMARKS.md
//! records the figures.
//!
//! Each measurement is the replay engine's own steady-state time: a first pass (not counted)
//! warms the cache, then `iters` passes are timed, each ending with whatever the trace left
//! live freed ([`ReplayOutcome::ns_per_op`]); criterion's throughput is per operation, so its
//! "thrpt" line reads operations per second and its time per iteration is one pass.
//!
//! `cargo bench -p cachalot-tools --bench replay`.

use std::path::{Path, PathBuf};
use std::time::Duration;

use cachalot::Settings;
use cachalot_tools::replay::{H200_MEMORY, ReplayConfig, ReplayProgram, SnapshotExt, replay};
use cachalot_tools::snapshot::{read_figures_for, read_snapshot};
use criterion::{Criterion, Throughput, criterion_group, criterion_main};

fn traces() -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/traces");
    let mut out: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "pickle"))
        .collect();
    out.sort();
    out
}

/// The first device's program and the configuration `cachalot replay --pytorch` uses.
fn load(pickle: &Path) -> (ReplayProgram, ReplayConfig) {
    let snapshot = read_snapshot(pickle).unwrap();
    let (device, program) = snapshot.replay_programs().into_iter().next().unwrap();
    let figures = read_figures_for(&pickle.with_extension("json"), device).ok();
    let conf = match &figures {
        Some(f) => f.pytorch_cuda_alloc_conf.clone().unwrap_or_default(),
        None => snapshot
            .allocator_settings
            .as_ref()
            .map(|s| s.alloc_conf.clone())
            .unwrap_or_default(),
    };
    let mut settings = Settings::pytorch().apply(&conf).unwrap();
    settings.per_process_memory_fraction = figures.as_ref().and_then(|f| f.memory_fraction);
    let config = ReplayConfig {
        settings,
        capacity: figures.map_or(H200_MEMORY, |f| f.device_total_memory),
        ..ReplayConfig::pytorch()
    };
    (program, config)
}

fn steady(c: &mut Criterion) {
    let mut g = c.benchmark_group("replay_steady");
    for pickle in traces() {
        let name = pickle.file_stem().unwrap().to_string_lossy().to_string();
        let (program, config) = load(&pickle);
        let ops = program.ops.len() as u64;
        g.throughput(Throughput::Elements(ops));
        g.bench_function(&name, |b| {
            b.iter_custom(|iters| {
                let config = ReplayConfig {
                    repeat: iters as usize + 1,
                    ..config.clone()
                };
                let out = replay(&program, &config).unwrap();
                Duration::from_nanos((out.ns_per_op * (ops * iters) as f64) as u64)
            })
        });
    }
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1));
    targets = steady
}
criterion_main!(benches);
