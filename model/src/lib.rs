//! `cachalot-model`: the executable specification of cachalot's caching-allocator policy.
//!
//! This crate is the oracle for the `cachalot` allocator. It implements the rules of
//! ARCHITECTURE.md ("The policy", PyTorch 2.x `CUDACachingAllocator` semantics, and "The
//! simulated device") as plainly as possible: a `Vec` of segments, each a `Vec` of blocks in
//! address order, found by linear scans. The differential harness in `cachalot-harness` runs the
//! same operations on both crates and compares, after every operation, the returned address or
//! error, every statistic and the segment/block layout. The two crates share no code.
//!
//! Statistics are not updated incrementally as PyTorch does: after each sub-step of an
//! operation the model recomputes every statistic's current value from its state and turns
//! the difference into increases and decreases.
//!
//! Code comments name the rule of ARCHITECTURE.md each step implements ("Rule 13: split").

mod adopt;
mod aliasing;
mod config;
mod device;
mod expandable;
mod invariants;
mod policy;
mod reclaim;
mod release;
mod rules;
mod runtime;
mod state;
mod stats;
mod stitching;
mod threads;

pub use adopt::{AdoptedBlock, AdoptedRange, AdoptedSegment, AdoptedState};
pub use config::{DEFAULT_EXPANDABLE_PAGE, MAX_ALLOC_SIZE, ModelConfig, ModelError};
pub use invariants::InvariantViolation;
pub use state::{BlockState, ModelBlock, ModelSegment};
pub use stats::{Stat, StatArray, Stats};

use device::Device;
use policy::Grown;
use state::{BlockState as State, Event, Segment};

/// The reference model of the caching allocator, with its own simulated device.
#[derive(Clone, Debug)]
pub struct Model {
    config: ModelConfig,
    device: Device,
    /// Every segment, and every range of expandable segments (rule 19), sorted by address.
    segments: Vec<Segment>,
    /// Outstanding events in the order they were recorded; a stream's events, in this order,
    /// are its FIFO.
    events: Vec<Event>,
    /// `⌊fraction × capacity⌋` once a memory fraction is set (rule 16).
    allowed: Option<u64>,
    /// The small pool's search counter (rule 6, for rule 12).
    small_searches: u64,
    /// The large pool's search counter (rule 6, for rule 12).
    large_searches: u64,
    stats: Stats,
    /// Rule 17: the threads' caches, in registration order.
    threads: Vec<threads::ThreadCache>,
    /// Rule 17: the thread each block handed out on a thread belongs to, while it is
    /// allocated (live or parked).
    owners: std::collections::BTreeMap<u64, u32>,
    /// Rule 20: the requested high-water `W`, the highest value `requested_bytes.all` has
    /// reached since the model was made (kept apart from the statistic's peak, which a
    /// reset of peak statistics would lower).
    requested_high_water: u64,
    /// Rule 22a: the model's page table — every page of every range, by page number: its
    /// home slot and its lent slots.
    pages: std::collections::BTreeMap<u64, aliasing::Page>,
    /// Rule 22a: every mapped slot of every range (under mapped and lent blocks), by its
    /// address: the page it maps.
    page_of: std::collections::BTreeMap<u64, u64>,
    /// The number the next page made gets.
    next_page: u64,
    /// Rule 22f: rule 20's limit for the request being served, once computed (at its first
    /// growth).
    request_limit: Option<u128>,
    /// Rule 23a: the stitched views, in the order made.
    views: Vec<stitching::View>,
    /// The number the next view made gets.
    next_view: u64,
    /// Rule 23g: a clock of view hand-outs and makings.
    view_tick: u64,
    /// Rule 23k: the device's log of stream waits, `(waiter, on)`, in the order made.
    stream_waits: Vec<(u64, u64)>,
    /// Rule 19j: the handles of more than one page, by first byte: their bytes. Every other
    /// mapped page of a range is a handle of its own.
    handles: std::collections::BTreeMap<u64, u64>,
    /// Rule 19j: how many handles map steps have made (the driver's price of growing).
    handles_made: u64,
}

/// Where a live allocation is: a block of a segment or range, or (rule 23) a view in use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Live {
    /// The block at (segment index, block index).
    Block(usize, usize),
    /// The view at this index of the views.
    View(usize),
}

impl Model {
    /// A model with `config`'s settings and an empty device.
    ///
    /// # Panics
    /// If `config.memory_fraction` is outside `[0, 1]` or NaN, `config.expandable_page` is
    /// not an even number of MiB in \[2, 1024\] (rule 19), or `config.reclaim_headroom` is
    /// outside `[0, 1]` or NaN (rule 20), or `config.page_stitching` and
    /// `config.page_aliasing` are both set (rule 23), or `config.expandable_handle` is not a
    /// whole number of MiB in \[2, 2^20\] or is set beside `config.page_aliasing` (rule 19j).
    pub fn new(config: ModelConfig) -> Model {
        assert!(
            config.expandable_page_is_valid(),
            "ModelConfig::expandable_page must be an even number of MiB in [2, 1024]"
        );
        assert!(
            config.reclaim_headroom_is_valid(),
            "ModelConfig::reclaim_headroom must be within [0, 1]"
        );
        assert!(
            config.stitching_is_valid(),
            "ModelConfig::page_stitching refuses page_aliasing beside it"
        );
        assert!(
            config.expandable_handle_is_valid(),
            "ModelConfig::expandable_handle must be whole MiB in [2, 2^20], without page_aliasing"
        );
        let device = Device::new(config.capacity, config.address_script.clone());
        let fraction = config.memory_fraction;
        let mut model = Model {
            config,
            device,
            segments: Vec::new(),
            events: Vec::new(),
            allowed: None,
            small_searches: 0,
            large_searches: 0,
            stats: Stats::default(),
            threads: Vec::new(),
            owners: std::collections::BTreeMap::new(),
            requested_high_water: 0,
            pages: std::collections::BTreeMap::new(),
            page_of: std::collections::BTreeMap::new(),
            next_page: 0,
            request_limit: None,
            views: Vec::new(),
            next_view: 0,
            view_tick: 0,
            stream_waits: Vec::new(),
            handles: std::collections::BTreeMap::new(),
            handles_made: 0,
        };
        if let Some(fraction) = fraction {
            model
                .set_memory_fraction(fraction)
                .expect("ModelConfig::memory_fraction must be within [0, 1]");
        }
        model
    }

    /// Allocates `size` bytes on `stream`: the block's address, 0 for a zero-size request.
    pub fn malloc(&mut self, size: u64, stream: u64) -> Result<u64, ModelError> {
        // Rule 1: zero-size and too-large requests touch nothing.
        if size == 0 {
            return Ok(0);
        }
        if size > MAX_ALLOC_SIZE {
            return Err(ModelError::TooLarge { requested: size });
        }
        // Rule 22f: a new request computes its own limit.
        self.request_limit = None;
        // Rule 5: process completed events first.
        self.process_events();
        // Rules 2, 3.
        let rounded = rules::round_size(size, &self.config.roundup_power2_divisions);
        let pool = rules::pool_for(rounded);
        // Rule 6, else rule 23d (a view), else rule 7.
        let grown = match self.best_fit(pool, stream, rounded) {
            Some(address) => Grown::Block(address),
            None => match self.view_candidate(pool, stream, rounded) {
                Some(v) => return Ok(self.hand_out_view(v, rounded, size)),
                None => self.make_block(pool, stream, rounded, size)?,
            },
        };
        match grown {
            // Rules 13, 14.
            Grown::Block(address) => Ok(self.hand_out(address, rounded, size)),
            // Rule 23f: a view made and handed out.
            Grown::View(address) => Ok(address),
        }
    }

    /// Frees the allocation at `address` (rule 15). Address 0 is a no-op.
    pub fn free(&mut self, address: u64) -> Result<(), ModelError> {
        // Rule 1: freeing the null address does nothing.
        if address == 0 {
            return Ok(());
        }
        let live = self.live_allocation(address)?;
        // Rule 17: a block freed for good belongs to no thread.
        self.owners.remove(&address);
        self.free_live(live);
        Ok(())
    }

    /// Records that `stream` uses the allocation at `address`, so that freeing it waits for
    /// `stream`'s work (rule 15). Using it on its own stream is a no-op; address 0 is a no-op,
    /// as PyTorch's `recordStream` of a null pointer.
    pub fn record_stream(&mut self, address: u64, stream: u64) -> Result<(), ModelError> {
        if address == 0 {
            return Ok(());
        }
        let live = self.live_allocation(address)?;
        let own = match live {
            Live::Block(s, _) => self.segments[s].stream,
            Live::View(v) => self.views[v].stream,
        };
        if own == stream {
            return Ok(());
        }
        let uses = match live {
            Live::Block(s, b) => &mut self.segments[s].blocks[b].stream_uses,
            // Rule 23e: rule 15's events apply to a view's allocation as to any block.
            Live::View(v) => &mut self.view_allocation(v).stream_uses,
        };
        if !uses.contains(&stream) {
            uses.push(stream);
            uses.sort_unstable();
        }
        Ok(())
    }

    /// Completes every event recorded on `stream` so far (later ones are not). Blocks are not
    /// returned here: that happens at the next malloc (rule 5) or at `empty_cache` (rule 9).
    pub fn complete_stream(&mut self, stream: u64) {
        for event in self.events.iter_mut().filter(|e| e.stream == stream) {
            event.complete = true;
        }
    }

    /// Frees every block parked in a thread cache (rule 17), then waits for all events and
    /// gives every cached whole segment back to the device (rule 9).
    pub fn empty_cache(&mut self) {
        self.flush_all_threads();
        self.release_cached_segments();
    }

    /// Caps reserved bytes at `⌊fraction × capacity⌋` (rule 16). The product is computed in
    /// `f64` and truncated, as PyTorch does.
    pub fn set_memory_fraction(&mut self, fraction: f64) -> Result<(), ModelError> {
        if !(0.0..=1.0).contains(&fraction) {
            return Err(ModelError::InvalidFraction { fraction });
        }
        self.allowed = Some((fraction * self.device.capacity() as f64) as u64);
        Ok(())
    }

    /// Makes the next `n` device allocation attempts report out-of-memory, in addition to any
    /// failures already pending. Attempts stopped by the memory fraction never reach the device and do
    /// not count. Under expandable segments each map step is one attempt (rule 19i), and under
    /// page aliasing each alias call too (rule 22h).
    pub fn fail_next_device_allocs(&mut self, n: u32) {
        self.device.fail_next(n);
    }

    /// Sets every statistic's peak to its current value (PyTorch's
    /// `reset_peak_memory_stats`). Rule 20's requested high-water is not lowered.
    pub fn reset_peak_stats(&mut self) {
        self.stats.reset_peaks();
    }

    /// The settings the model was made with.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// Every statistic.
    pub fn stats(&self) -> Stats {
        self.stats.clone()
    }

    /// Every segment, sorted by address, with its blocks in address order; under expandable
    /// segments, one segment per maximal run of mapped blocks of a range, marked
    /// `expandable` (rule 19h).
    pub fn layout(&self) -> Vec<ModelSegment> {
        let mut layout = Vec::new();
        for segment in &self.segments {
            if segment.expandable {
                layout.extend(Model::range_view(segment));
            } else {
                layout.push(segment.view());
            }
        }
        layout
    }

    /// Bytes the simulated device has handed out and not had back, mapped bytes of ranges
    /// included (rule 19), each page once however many slots map it (rule 22h).
    pub fn device_used(&self) -> u64 {
        self.device.used()
    }

    /// Where the allocation at `address` is, whether the user holds it or (rule 17) it is
    /// parked: an allocated block starting there, or (rule 23) a view whose allocation is
    /// allocated.
    pub(crate) fn allocation_at(&self, address: u64) -> Option<Live> {
        if let Some(v) = self.view_in_use_at(address) {
            let allocated = self.views[v]
                .allocation
                .as_ref()
                .is_some_and(|a| a.state == State::Allocated);
            return allocated.then_some(Live::View(v));
        }
        match state::find_block(&self.segments, address) {
            Some((s, b)) if self.segments[s].blocks[b].state == State::Allocated => {
                Some(Live::Block(s, b))
            }
            _ => None,
        }
    }

    /// The stream, requested size and whether another stream used it, of the allocation at
    /// `live`.
    pub(crate) fn live_facts(&self, live: Live) -> (u64, u64, bool) {
        match live {
            Live::Block(s, b) => {
                let block = &self.segments[s].blocks[b];
                (
                    self.segments[s].stream,
                    block.requested,
                    !block.stream_uses.is_empty(),
                )
            }
            Live::View(v) => {
                let a = self.views[v].allocation.as_ref().expect("a view in use");
                (self.views[v].stream, a.requested, !a.stream_uses.is_empty())
            }
        }
    }

    /// Rule 15 (and 23e) for the allocation at `live`.
    pub(crate) fn free_live(&mut self, live: Live) {
        match live {
            Live::Block(s, b) => self.free_allocation(s, b),
            Live::View(v) => self.free_view_allocation(v),
        }
    }

    /// Where the live allocation at `address` is, or `UnknownAddress` (also for a block
    /// parked in a thread cache: the user freed it, rule 17).
    fn live_allocation(&self, address: u64) -> Result<Live, ModelError> {
        match self.allocation_at(address) {
            Some(live) if !self.is_parked(address) => Ok(live),
            _ => Err(ModelError::UnknownAddress { address }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn model() -> Model {
        Model::new(ModelConfig::pytorch_defaults(1 << 30))
    }

    #[test]
    fn zero_size_requests_return_null_and_touch_nothing() {
        let mut model = model();
        assert_eq!(model.malloc(0, 0), Ok(0));
        assert_eq!(model.free(0), Ok(()));
        assert_eq!(model.stats(), Stats::default());
        assert!(model.layout().is_empty());
    }

    #[test]
    fn requests_above_two_to_the_sixty_are_too_large() {
        let mut model = model();
        let size = MAX_ALLOC_SIZE + 1;
        assert_eq!(
            model.malloc(size, 0),
            Err(ModelError::TooLarge { requested: size })
        );
        assert_eq!(model.stats(), Stats::default());
    }

    #[test]
    fn recording_a_stream_on_the_null_address_is_a_no_op() {
        let mut model = model();
        let before = model.clone();
        assert_eq!(model.record_stream(0, 3), Ok(()));
        assert_eq!(model.stats(), before.stats());
        assert_eq!(model.layout(), before.layout());
        // Any other address that is not a live allocation is an error.
        assert_eq!(
            model.record_stream(512, 3),
            Err(ModelError::UnknownAddress { address: 512 })
        );
    }

    #[test]
    fn freeing_an_unknown_or_inner_address_is_an_error() {
        let mut model = model();
        let a = model.malloc(4096, 0).unwrap();
        assert_eq!(
            model.free(a + 512),
            Err(ModelError::UnknownAddress { address: a + 512 })
        );
        model.free(a).unwrap();
        assert_eq!(
            model.free(a),
            Err(ModelError::UnknownAddress { address: a })
        );
        assert_eq!(
            model.record_stream(a, 1),
            Err(ModelError::UnknownAddress { address: a })
        );
        model.check_invariants().unwrap();
    }

    #[test]
    fn memory_fractions_outside_zero_to_one_are_rejected() {
        let mut model = model();
        for fraction in [-0.1, 1.5, f64::NAN] {
            assert!(matches!(
                model.set_memory_fraction(fraction),
                Err(ModelError::InvalidFraction { .. })
            ));
        }
        assert_eq!(model.set_memory_fraction(0.5), Ok(()));
        assert_eq!(model.allowed, Some(512 * MIB));
    }

    #[test]
    fn the_layout_lists_segments_by_address_with_blocks_in_order() {
        let mut model = model();
        let a = model.malloc(MIB + 1, 0).unwrap();
        let b = model.malloc(100, 0).unwrap();
        let layout = model.layout();
        assert_eq!(layout.len(), 2);
        assert!(layout[0].address < layout[1].address);
        assert_eq!(layout[0].blocks[0].address, a);
        assert_eq!(layout[0].blocks[0].requested, MIB + 1);
        assert_eq!(layout[0].blocks[1].requested, 0);
        assert_eq!(layout[1].blocks[0].address, b);
        assert!(layout[1].small);
        // Expandable segments are off by default (rule 19).
        assert!(!model.config().expandable_segments);
        assert!(layout.iter().all(|s| !s.expandable));
    }
}
