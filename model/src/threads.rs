//! Rule 17: thread caches, cachalot's own policy (off under PyTorch's settings).
//!
//! Each thread keeps, oldest first, up to `thread_cache_blocks` blocks it freed — *parked*
//! blocks. A parked block stays allocated in the segments, so every statistic and the layout
//! count it as allocated; only [`Model::free`] and [`Model::record_stream`] treat it as gone.
//! A thread joins the registration order at its first request (rule 17's flush order).

use crate::{MAX_ALLOC_SIZE, Model, ModelError};

/// One thread's cache.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct ThreadCache {
    /// The thread, as the caller names it.
    pub(crate) id: u32,
    /// Addresses of its parked blocks, oldest first.
    pub(crate) parked: Vec<u64>,
}

impl Model {
    fn capacity(&self) -> usize {
        self.config.thread_cache_blocks as usize
    }

    /// Whether the block at `address` is parked in a thread cache.
    pub(crate) fn is_parked(&self, address: u64) -> bool {
        self.threads.iter().any(|t| t.parked.contains(&address))
    }

    fn thread_index(&self, thread: u32) -> Option<usize> {
        self.threads.iter().position(|t| t.id == thread)
    }

    /// Allocates `size` bytes on `stream` for `thread` (rule 17a): the most recently parked
    /// block of `thread` with the same stream and requested size comes back with no other
    /// effect; else rules 1–14, and on out-of-memory with blocks parked anywhere, every
    /// parked block is freed and the request made once more.
    pub fn malloc_on(&mut self, thread: u32, size: u64, stream: u64) -> Result<u64, ModelError> {
        // Rule 1 comes first; without thread caches this is rules 1–14 alone.
        if self.capacity() == 0 || size == 0 || size > MAX_ALLOC_SIZE {
            return self.malloc(size, stream);
        }
        let index = match self.thread_index(thread) {
            Some(i) => i,
            None => {
                self.threads.push(ThreadCache {
                    id: thread,
                    parked: Vec::new(),
                });
                self.threads.len() - 1
            }
        };
        // Rule 17a: a hit, newest first.
        let hit = self.threads[index].parked.iter().rposition(|&a| {
            let live = self.allocation_at(a).expect("a parked block exists");
            let (own, requested, _) = self.live_facts(live);
            own == stream && requested == size
        });
        if let Some(i) = hit {
            return Ok(self.threads[index].parked.remove(i));
        }
        // Rule 17a: parked blocks before new memory — when the cache cannot serve the request,
        // every parked block is freed first.
        if self.thread_cached_blocks() > 0 && !self.has_cached_block(size, stream) {
            self.flush_all_threads();
        }
        let mut result = self.malloc(size, stream);
        if matches!(result, Err(ModelError::OutOfMemory { .. }))
            && self.threads.iter().any(|t| !t.parked.is_empty())
        {
            self.flush_all_threads();
            result = self.malloc(size, stream);
        }
        if let Ok(address) = result {
            self.owners.insert(address, thread);
        }
        result
    }

    /// Frees the allocation at `address` on `thread` (rule 17b): a small-pool block (requested
    /// size at most 1 MiB) that belongs to `thread` and no other stream used is parked, and the thread's oldest parked block is
    /// freed if that makes one too many; any other free is rule 15.
    pub fn free_on(&mut self, thread: u32, address: u64) -> Result<(), ModelError> {
        if self.capacity() == 0 || address == 0 {
            return self.free(address);
        }
        let live = self.live_allocation(address)?;
        let (_, requested, used_elsewhere) = self.live_facts(live);
        let parkable = self.owners.get(&address) == Some(&thread)
            && !used_elsewhere
            && requested <= crate::rules::SMALL_SIZE;
        if !parkable {
            return self.free(address);
        }
        let index = self
            .thread_index(thread)
            .expect("a thread that was handed a block is registered");
        self.threads[index].parked.push(address);
        if self.threads[index].parked.len() > self.capacity() {
            let oldest = self.threads[index].parked.remove(0);
            self.free_parked(oldest);
        }
        Ok(())
    }

    /// Frees the blocks parked by `thread`, oldest first (rule 17d).
    pub fn flush_thread(&mut self, thread: u32) {
        if let Some(index) = self.thread_index(thread) {
            for address in std::mem::take(&mut self.threads[index].parked) {
                self.free_parked(address);
            }
        }
    }

    /// `thread` exits (rule 17e): its parked blocks are freed, its blocks belong to no
    /// thread, and it leaves the registration order.
    pub fn retire_thread(&mut self, thread: u32) {
        self.flush_thread(thread);
        self.owners.retain(|_, t| *t != thread);
        self.threads.retain(|t| t.id != thread);
    }

    /// Blocks parked in thread caches, all threads together.
    pub fn thread_cached_blocks(&self) -> usize {
        self.threads.iter().map(|t| t.parked.len()).sum()
    }

    /// Rule 17d: every thread's parked blocks, threads in registration order.
    pub(crate) fn flush_all_threads(&mut self) {
        for index in 0..self.threads.len() {
            for address in std::mem::take(&mut self.threads[index].parked) {
                self.free_parked(address);
            }
        }
    }

    /// A parked block (already out of its cache) is freed by rule 15.
    fn free_parked(&mut self, address: u64) {
        self.owners.remove(&address);
        let live = self.allocation_at(address).expect("a parked block exists");
        self.free_live(live);
    }

    /// Parked and owned blocks are allocated; no cache is over capacity; a block is parked
    /// once at most, by the thread it belongs to.
    pub(crate) fn check_threads(&self) -> Result<(), crate::InvariantViolation> {
        use crate::InvariantViolation;
        let allocated = |a: u64| self.allocation_at(a).is_some();
        for &a in self.owners.keys() {
            if !allocated(a) {
                return Err(InvariantViolation::OwnedNotAllocated { address: a });
            }
        }
        let mut all: Vec<u64> = Vec::new();
        for t in &self.threads {
            if t.parked.len() > self.capacity() {
                return Err(InvariantViolation::ThreadCacheOverfull {
                    thread: t.id,
                    parked: t.parked.len(),
                });
            }
            for &a in &t.parked {
                if self.owners.get(&a) != Some(&t.id) {
                    return Err(InvariantViolation::ParkedNotOwn {
                        thread: t.id,
                        address: a,
                    });
                }
                all.push(a);
            }
        }
        let n = all.len();
        all.sort_unstable();
        all.dedup();
        if all.len() != n {
            return Err(InvariantViolation::ParkedTwice);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use crate::{Model, ModelConfig, ModelError};

    fn model(n: u32) -> Model {
        let mut c = ModelConfig::pytorch_defaults(1 << 30);
        c.thread_cache_blocks = n;
        Model::new(c)
    }

    #[test]
    fn a_parked_block_comes_back_to_its_thread_and_stays_allocated() {
        let mut m = model(2);
        let a = m.malloc_on(1, 4096, 0).unwrap();
        m.free_on(1, a).unwrap();
        assert_eq!(m.stats().allocation.all.current, 1);
        assert_eq!(m.free(a), Err(ModelError::UnknownAddress { address: a }));
        // Another thread, another size or another stream does not take it.
        assert_ne!(m.malloc_on(2, 4096, 0).unwrap(), a);
        assert_ne!(m.malloc_on(1, 4095, 0).unwrap(), a);
        assert_ne!(m.malloc_on(1, 4096, 1).unwrap(), a);
        assert_eq!(m.malloc_on(1, 4096, 0).unwrap(), a);
        m.check_invariants().unwrap();
    }

    #[test]
    fn the_oldest_block_leaves_a_full_cache_and_empty_cache_flushes() {
        let mut m = model(1);
        let a = m.malloc_on(1, 512, 0).unwrap();
        let b = m.malloc_on(1, 1024, 0).unwrap();
        m.free_on(1, a).unwrap();
        m.free_on(1, b).unwrap();
        assert_eq!(m.thread_cached_blocks(), 1);
        assert_eq!(m.stats().allocation.all.current, 1);
        m.empty_cache();
        assert_eq!(m.thread_cached_blocks(), 0);
        assert_eq!(m.device_used(), 0);
        m.check_invariants().unwrap();
    }

    #[test]
    fn parked_blocks_go_back_before_the_device_grows() {
        let mib = 1 << 20;
        let mut m = model(8);
        // One small-pool segment (2 MiB), filled by two 1 MiB blocks; one is parked.
        let a = m.malloc_on(1, mib, 0).unwrap();
        let x = m.malloc_on(1, mib, 0).unwrap();
        m.free_on(1, a).unwrap();
        assert_eq!(m.thread_cached_blocks(), 1);
        // Another size: no parked hit, and no cached block serves it, so the parked block is
        // freed first and serves the request; the device does not grow.
        let b = m.malloc_on(1, mib - 4096, 0).unwrap();
        assert_eq!(b, a);
        assert_eq!(m.thread_cached_blocks(), 0);
        assert_eq!(m.device_used(), 2 * mib);
        m.free(x).unwrap();
        // A request the cache can serve leaves parked blocks parked.
        let c = m.malloc_on(2, 4096, 0).unwrap();
        m.free_on(2, c).unwrap();
        let d = m.malloc_on(2, 8192, 0).unwrap();
        assert_ne!(d, c);
        assert_eq!(m.thread_cached_blocks(), 1);
        m.check_invariants().unwrap();
    }

    #[test]
    fn only_small_pool_blocks_are_parked() {
        // Rule 17b: a request of at most 1 MiB is a small-pool block and is parked; a larger
        // one is freed at once (its pages stay free for rules 20 and 23).
        let mib = 1 << 20;
        let mut m = model(8);
        let small = m.malloc_on(1, mib, 0).unwrap();
        let large = m.malloc_on(1, mib + 1, 0).unwrap();
        m.free_on(1, small).unwrap();
        m.free_on(1, large).unwrap();
        assert_eq!(m.thread_cached_blocks(), 1);
        assert_eq!(m.stats().allocation.all.current, 1);
        assert_eq!(
            m.free(large),
            Err(ModelError::UnknownAddress { address: large })
        );
        assert_eq!(m.malloc_on(1, mib, 0).unwrap(), small);
        m.check_invariants().unwrap();
    }

    #[test]
    fn cross_stream_and_foreign_frees_are_not_parked() {
        let mut m = model(4);
        let a = m.malloc_on(1, 512, 0).unwrap();
        let b = m.malloc_on(1, 512, 0).unwrap();
        m.record_stream(a, 1).unwrap();
        m.free_on(1, a).unwrap();
        m.free_on(2, b).unwrap();
        assert_eq!(m.thread_cached_blocks(), 0);
        assert_eq!(m.stats().allocation.all.current, 0);
    }

    #[test]
    fn without_thread_caches_the_threaded_calls_are_the_plain_ones() {
        let mut m = model(0);
        let a = m.malloc_on(1, 512, 0).unwrap();
        m.free_on(1, a).unwrap();
        assert_eq!(m.stats().allocation.all.current, 0);
        assert_eq!(m.thread_cached_blocks(), 0);
    }
}
