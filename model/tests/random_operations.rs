//! Long pseudo-random operation sequences on several configurations, checking the invariants
//! and the returned blocks after every operation.

use cachalot_model::{BlockState, Model, ModelConfig, ModelError};
use rand::rngs::Xoshiro256PlusPlus;
use rand::{RngExt, SeedableRng};

const MIB: u64 = 1 << 20;

/// A deterministic generator (`rand`'s xoshiro256++, seeded), so that failures reproduce.
struct Rng(Xoshiro256PlusPlus);

impl Rng {
    fn seeded(seed: u64) -> Rng {
        Rng(Xoshiro256PlusPlus::seed_from_u64(seed))
    }
    fn below(&mut self, n: u64) -> u64 {
        self.0.random_range(0..n)
    }
}

/// A request size spread over small, large and oversize requests.
fn size(rng: &mut Rng) -> u64 {
    match rng.below(6) {
        0 => 1 + rng.below(4096),
        1 => 1 + rng.below(MIB),
        2 => MIB + rng.below(9 * MIB),
        3 => 10 * MIB + rng.below(30 * MIB),
        4 => 1 + rng.below(64) * 512,
        _ => 40 * MIB + rng.below(60 * MIB),
    }
}

fn run(config: ModelConfig, seed: u64, steps: usize) {
    let mut rng = Rng::seeded(seed);
    let mut model = Model::new(config);
    let mut live: Vec<u64> = Vec::new();
    for step in 0..steps {
        // Keep the live set small, so that most mallocs can succeed.
        let op = if live.len() > 8 { 60 } else { rng.below(100) };
        let stream = rng.below(3);
        if op < 45 {
            let size = size(&mut rng);
            match model.malloc(size, stream) {
                Ok(address) => {
                    let block = model
                        .layout()
                        .into_iter()
                        .flat_map(|s| s.blocks)
                        .find(|b| b.address == address)
                        .expect("the returned address is a block");
                    assert_eq!(block.state, BlockState::Allocated, "step {step}");
                    assert_eq!(block.requested, size, "step {step}");
                    assert!(block.size >= size, "step {step}");
                    live.push(address);
                }
                Err(ModelError::OutOfMemory { .. }) => {}
                Err(other) => panic!("step {step}: unexpected {other}"),
            }
        } else if op < 80 && !live.is_empty() {
            let address = live.swap_remove(rng.below(live.len() as u64) as usize);
            model.free(address).expect("free of a live allocation");
        } else if op < 90 && !live.is_empty() {
            let address = live[rng.below(live.len() as u64) as usize];
            model.record_stream(address, rng.below(4)).unwrap();
        } else if op < 97 {
            model.complete_stream(stream);
        } else {
            model.empty_cache();
        }
        if let Err(error) = model.check_invariants() {
            panic!("step {step}: {error}\n{:#?}", model.layout());
        }
    }
    assert!(model.stats().num_device_alloc > 0);
}

#[test]
fn random_sequences_keep_the_invariants_with_pytorch_defaults() {
    for seed in 1..=4 {
        run(ModelConfig::pytorch_defaults(512 * MIB), seed, 3000);
    }
}

#[test]
fn random_sequences_keep_the_invariants_with_every_setting_on() {
    for seed in 1..=4 {
        let mut config = ModelConfig::pytorch_defaults(512 * MIB);
        config.max_split_size = 32 * MIB;
        config.garbage_collection_threshold = 0.6;
        config.memory_fraction = Some(0.7);
        config.roundup_power2_divisions = [4; 16];
        run(config, seed, 3000);
    }
}

#[test]
fn random_sequences_keep_the_invariants_on_a_tiny_device() {
    for seed in 1..=4 {
        let mut config = ModelConfig::pytorch_defaults(120 * MIB);
        config.max_split_size = 24 * MIB;
        run(config, seed, 3000);
    }
}

#[test]
fn random_sequences_keep_the_invariants_with_expandable_segments() {
    for seed in 1..=4 {
        let mut config = ModelConfig::pytorch_defaults(512 * MIB);
        config.expandable_segments = true;
        run(config, seed, 3000);
    }
}

#[test]
fn random_sequences_keep_the_invariants_with_expandable_segments_and_every_setting_on() {
    for seed in 1..=4 {
        let mut config = ModelConfig::pytorch_defaults(512 * MIB);
        config.expandable_segments = true;
        config.max_split_size = 32 * MIB;
        config.garbage_collection_threshold = 0.6;
        config.memory_fraction = Some(0.7);
        config.roundup_power2_divisions = [4; 16];
        run(config, seed, 3000);
    }
}

#[test]
fn random_sequences_keep_the_invariants_with_expandable_segments_on_a_tiny_device() {
    for seed in 1..=4 {
        let mut config = ModelConfig::pytorch_defaults(120 * MIB);
        config.expandable_segments = true;
        config.max_split_size = 24 * MIB;
        run(config, seed, 3000);
    }
}

#[test]
fn random_sequences_keep_the_invariants_with_cachalots_own_policy() {
    // Rule 21's expandable settings: 2 MiB pages in both pools, reclaim with 2.5 % headroom.
    for seed in 1..=4 {
        let mut config = ModelConfig::pytorch_defaults(512 * MIB);
        config.expandable_segments = true;
        config.expandable_page = 2 * MIB;
        config.reclaim_headroom = Some(0.025);
        run(config, seed, 3000);
    }
}

#[test]
fn random_sequences_keep_the_invariants_with_reclaim_on_a_tiny_device() {
    for (seed, headroom) in [(1, 0.0), (2, 0.25), (3, 0.0), (4, 1.0)] {
        let mut config = ModelConfig::pytorch_defaults(120 * MIB);
        config.expandable_segments = true;
        config.max_split_size = 24 * MIB;
        config.memory_fraction = Some(0.8);
        config.reclaim_headroom = Some(headroom);
        run(config, seed, 3000);
    }
}

#[test]
fn random_sequences_keep_the_invariants_with_page_aliasing() {
    // Rule 21's policy with rule 22: pages move by aliasing.
    for seed in 1..=6 {
        let mut config = ModelConfig::pytorch_defaults(512 * MIB);
        config.expandable_segments = true;
        config.expandable_page = 2 * MIB;
        config.reclaim_headroom = Some(0.025);
        config.page_aliasing = true;
        run(config, seed, 3000);
    }
}

#[test]
fn random_sequences_keep_the_invariants_with_page_aliasing_on_a_tiny_device() {
    for (seed, headroom, page) in [(1, 0.0, 2), (2, 0.25, 2), (3, 0.0, 20), (4, 1.0, 2)] {
        let mut config = ModelConfig::pytorch_defaults(120 * MIB);
        config.expandable_segments = true;
        config.expandable_page = page * MIB;
        config.max_split_size = 24 * MIB;
        config.memory_fraction = Some(0.8);
        config.reclaim_headroom = Some(headroom);
        config.page_aliasing = true;
        run(config, seed, 3000);
    }
}

/// Requests of whole MiB on one stream, frees and cache releases: the patterns of pages
/// lent, re-homed and borrowed back and forth (rule 22) that random search found a
/// non-terminating growth in.
fn run_whole_mebibytes(config: ModelConfig, seed: u64, steps: usize) {
    let mut rng = Rng::seeded(seed);
    let mut model = Model::new(config);
    let mut live: Vec<u64> = Vec::new();
    for step in 0..steps {
        let op = rng.below(100);
        if op < 50 {
            match model.malloc((1 + rng.below(8)) * MIB, 0) {
                Ok(address) => live.push(address),
                Err(ModelError::OutOfMemory { .. }) => {}
                Err(other) => panic!("step {step}: unexpected {other}"),
            }
        } else if op < 92 && !live.is_empty() {
            let address = live.swap_remove(rng.below(live.len() as u64) as usize);
            model.free(address).expect("free of a live allocation");
        } else if op >= 92 {
            model.empty_cache();
        }
        if let Err(error) = model.check_invariants() {
            panic!("seed {seed}, step {step}: {error}");
        }
    }
}

#[test]
fn whole_mebibyte_sequences_keep_the_invariants_and_end_every_growth_with_page_aliasing() {
    for seed in 0..600 {
        let mut config =
            ModelConfig::pytorch_defaults(if seed % 2 == 0 { 64 * MIB } else { 1 << 30 });
        config.expandable_segments = true;
        config.expandable_page = 2 * MIB;
        config.reclaim_headroom = Some([0.0, 0.025, 0.25][(seed % 3) as usize]);
        config.page_aliasing = true;
        run_whole_mebibytes(config, seed, 300);
    }
}
