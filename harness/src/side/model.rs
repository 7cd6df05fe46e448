//! The reference model as a [`Side`], and the conversions between the harness's plain numbers
//! and `cachalot-model`'s types.

use cachalot_model::{Model, ModelConfig, ModelError};

use super::{
    Adoption, AdoptionState, BlockKind, BlockView, Call, Observation, Outcome, SegmentView, Side,
    flatten_stats,
};
use crate::scenario::Knobs;

/// The model's configuration for `knobs`.
pub fn model_config(knobs: &Knobs) -> ModelConfig {
    let mut c = ModelConfig::pytorch_defaults(knobs.capacity);
    c.max_split_size = knobs.max_split_size;
    c.max_non_split_rounding_size = knobs.max_non_split_rounding_size;
    c.garbage_collection_threshold = knobs.garbage_collection_threshold;
    c.roundup_power2_divisions = knobs.roundup_power2_divisions;
    c.memory_fraction = knobs.memory_fraction;
    c.thread_cache_blocks = knobs.thread_cache_blocks;
    c.address_script = knobs.address_script.clone();
    c.expandable_segments = knobs.expandable_segments;
    c.expandable_page = knobs.expandable_page;
    c.reclaim_headroom = knobs.reclaim_headroom;
    c.page_aliasing = knobs.page_aliasing;
    c.page_stitching = knobs.page_stitching;
    c.expandable_handle = knobs.expandable_handle;
    c
}

/// A range to adopt as the model takes it (rule 18f).
fn to_model_range(a: &Adoption) -> cachalot_model::AdoptedRange {
    let segment = to_model(a);
    cachalot_model::AdoptedRange {
        address: segment.address,
        stream: segment.stream,
        small: segment.small,
        blocks: segment.blocks,
    }
}

/// A segment to adopt as the model takes it.
fn to_model(a: &Adoption) -> cachalot_model::AdoptedSegment {
    cachalot_model::AdoptedSegment {
        address: a.address,
        size: a.size,
        stream: a.stream,
        small: a.small,
        blocks: a
            .blocks
            .iter()
            .map(|b| cachalot_model::AdoptedBlock {
                size: b.size,
                state: match &b.state {
                    AdoptionState::Free => cachalot_model::AdoptedState::Free,
                    AdoptionState::Unmapped => cachalot_model::AdoptedState::Unmapped,
                    AdoptionState::Allocated { requested } => {
                        cachalot_model::AdoptedState::Allocated {
                            requested: *requested,
                        }
                    }
                    AdoptionState::Pending { requested, streams } => {
                        cachalot_model::AdoptedState::Pending {
                            requested: *requested,
                            streams: streams.clone(),
                        }
                    }
                },
            })
            .collect(),
    }
}

/// The model's result as an [`Outcome`], with `value` giving the number to compare.
fn outcome<T>(r: Result<T, ModelError>, value: impl Fn(T) -> u64) -> Outcome {
    match r {
        Ok(v) => Outcome::Ok(value(v)),
        Err(ModelError::OutOfMemory {
            alloc_size,
            capacity,
            device_free,
            allowed,
            allocated,
            reserved_unallocated,
        }) => Outcome::OutOfMemory {
            alloc_size,
            capacity,
            device_free,
            allowed,
            allocated,
            reserved_unallocated,
        },
        Err(ModelError::TooLarge { .. }) => Outcome::TooLarge,
        Err(ModelError::UnknownAddress { .. }) => Outcome::UnknownPointer,
        Err(ModelError::InvalidFraction { .. }) => Outcome::InvalidFraction,
        Err(ModelError::InvalidAdoption { .. }) => Outcome::InvalidAdoption,
        Err(ModelError::AdoptionOutOfMemory { .. }) => Outcome::AdoptionOutOfMemory,
        Err(ModelError::UnsupportedChange) => Outcome::Unsupported,
    }
}

/// One of the model's segments in the common form, without its blocks (an empty `Vec`, which
/// allocates nothing): [`ModelSide`]'s observation and the driver's quick comparison
/// ([`super::quick`]) convert through this one function.
pub(super) fn segment_head(s: &cachalot_model::ModelSegment) -> SegmentView {
    SegmentView {
        address: s.address,
        size: s.size,
        stream: s.stream,
        small: s.small,
        expandable: s.expandable,
        blocks: Vec::new(),
    }
}

/// One of the model's blocks in the common form ([`ModelSide`]'s observation and
/// [`super::quick`]).
pub(super) fn block_view(b: &cachalot_model::ModelBlock) -> BlockView {
    let kind = match b.state {
        cachalot_model::BlockState::Free => BlockKind::Free,
        cachalot_model::BlockState::Allocated => BlockKind::Allocated,
        cachalot_model::BlockState::Pending => BlockKind::Pending,
        cachalot_model::BlockState::Held => BlockKind::Held,
    };
    BlockView {
        address: b.address,
        size: b.size,
        requested: if matches!(kind, BlockKind::Free | BlockKind::Held) {
            0
        } else {
            b.requested
        },
        kind,
    }
}

/// The reference model: rules 1–16 alone, or with rule 17's thread caches.
pub struct ModelSide {
    model: Model,
    threads: bool,
}

impl ModelSide {
    /// The model configured by `knobs`, making every call on one thread through rules 1–16
    /// (what the core implements).
    pub fn new(knobs: &Knobs) -> ModelSide {
        ModelSide {
            model: Model::new(model_config(knobs)),
            threads: false,
        }
    }

    /// The model made from `config` itself, on one thread (rules 1–16).
    pub fn from_config(config: ModelConfig) -> ModelSide {
        ModelSide {
            model: Model::new(config),
            threads: false,
        }
    }

    /// The model itself, to read what the [`Side`] interface does not report (rule 23's
    /// views).
    pub fn model(&self) -> &Model {
        &self.model
    }

    /// The model configured by `knobs`, making each call on the thread it names (rule 17:
    /// what the front end implements).
    pub fn threaded(knobs: &Knobs) -> ModelSide {
        ModelSide {
            model: Model::new(model_config(knobs)),
            threads: true,
        }
    }
}

impl Side for ModelSide {
    fn name(&self) -> &'static str {
        "model"
    }

    fn call(&mut self, call: &Call) -> Outcome {
        let m = &mut self.model;
        match *call {
            Call::Malloc {
                thread,
                size,
                stream,
            } if self.threads => outcome(m.malloc_on(u32::from(thread), size, stream), |a| a),
            Call::Malloc { size, stream, .. } => outcome(m.malloc(size, stream), |a| a),
            Call::Free { thread, address } if self.threads => {
                outcome(m.free_on(u32::from(thread), address), |()| 0)
            }
            Call::Free { address, .. } => outcome(m.free(address), |()| 0),
            Call::RecordStream {
                address, stream, ..
            } => outcome(m.record_stream(address, stream), |()| 0),
            Call::CompleteStream { stream } => {
                m.complete_stream(stream);
                Outcome::Ok(0)
            }
            Call::EmptyCache { .. } => {
                m.empty_cache();
                Outcome::Ok(0)
            }
            Call::SetFraction { fraction, .. } => outcome(m.set_memory_fraction(fraction), |()| 0),
            Call::SetRuntimeSettings {
                max_split_size,
                max_non_split_rounding_size,
                garbage_collection_threshold,
                roundup_power2_divisions,
            } => {
                let config = cachalot_model::ModelConfig {
                    max_split_size,
                    max_non_split_rounding_size,
                    garbage_collection_threshold,
                    roundup_power2_divisions,
                    ..m.config().clone()
                };
                outcome(m.set_runtime_settings(config), |()| 0)
            }
            Call::ReleaseStream { stream } => {
                m.release_stream_cache(stream);
                Outcome::Ok(0)
            }
            Call::FailDeviceAllocs { n } => {
                m.fail_next_device_allocs(n);
                Outcome::Ok(0)
            }
            Call::Adopt { ref segment } if segment.range => {
                outcome(m.adopt_range(to_model_range(segment)), |()| 0)
            }
            Call::Adopt { ref segment } => outcome(m.adopt_segment(to_model(segment)), |()| 0),
            Call::SetNextAddress { address } => {
                m.set_next_address(address);
                Outcome::Ok(0)
            }
            Call::FlushThread { thread } => {
                if self.threads {
                    m.flush_thread(u32::from(thread));
                }
                Outcome::Ok(0)
            }
            Call::RetireThread { thread } => {
                if self.threads {
                    m.retire_thread(u32::from(thread));
                }
                Outcome::Ok(0)
            }
        }
    }

    fn observe(&self) -> Result<Observation, String> {
        let layout = self
            .model
            .layout()
            .iter()
            .map(|s| SegmentView {
                blocks: s.blocks.iter().map(block_view).collect(),
                ..segment_head(s)
            })
            .collect();
        Ok(Observation {
            stats: flatten_stats(&self.model.stats())?,
            layout,
            device_used: self.model.device_used(),
            thread_cached_blocks: self.model.thread_cached_blocks(),
            stream_waits: super::stream_waits_observed(
                self.model.stream_waits().len(),
                self.model.stream_waits().iter().copied(),
            ),
        })
    }

    fn check_invariants(&self) -> Result<(), String> {
        self.model.check_invariants().map_err(|e| e.to_string())
    }

    fn as_model(&self) -> Option<&ModelSide> {
        Some(self)
    }
}
