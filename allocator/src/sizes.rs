//! Sizes: how a request is rounded, which pool serves it, and how large a new segment is.
//!
//! The one rule of this module: every size the policy reasons about is derived here, from
//! PyTorch's constants, so that the rounding of a request never differs between call sites.

/// Every block is at least this large, and every size is a multiple of it.
pub const MIN_BLOCK_SIZE: u64 = 512;
/// The largest request (after rounding) served by the small pool: 1 MiB.
pub const SMALL_SIZE: u64 = 1 << 20;
/// Small-pool segments are this large: 2 MiB.
pub const SMALL_BUFFER: u64 = 2 << 20;
/// Large requests below [`MIN_LARGE_ALLOC`] share segments of this size: 20 MiB.
pub const LARGE_BUFFER: u64 = 20 << 20;
/// Requests at least this large get a segment of their own size: 10 MiB.
pub const MIN_LARGE_ALLOC: u64 = 10 << 20;
/// Large segments are rounded up to a multiple of this: 2 MiB.
pub const ROUND_LARGE: u64 = 2 << 20;
/// Requests above this are refused as [`crate::Error::TooLarge`] before any rounding.
pub const MAX_ALLOC_SIZE: u64 = 1 << 60;

/// The two pools of cached blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize)]
pub enum Pool {
    /// Requests of at most 1 MiB, packed into 2 MiB segments.
    Small,
    /// Requests above 1 MiB.
    Large,
}

impl Pool {
    /// The pool that serves a request of `rounded` bytes (already rounded by [`round_size`]).
    #[inline]
    pub fn for_size(rounded: u64) -> Pool {
        if rounded <= SMALL_SIZE {
            Pool::Small
        } else {
            Pool::Large
        }
    }

    /// 0 for the small pool, 1 for the large one: an index into per-pool arrays.
    #[inline]
    pub fn index(self) -> usize {
        match self {
            Pool::Small => 0,
            Pool::Large => 1,
        }
    }
}

/// The index into `roundup_power2_divisions` for a size: one interval per power of two from
/// 1 MiB (index 0, which also covers smaller sizes) to 32 GiB and above (index 15).
#[inline]
pub fn division_index(size: u64) -> usize {
    let log = 63 - size.max(1).leading_zeros() as i64;
    (log - 20).clamp(0, 15) as usize
}

/// Rounds `size` (which must be at most [`MAX_ALLOC_SIZE`]) the way PyTorch does: to 512 B, or
/// to the next power-of-two division when `roundup_power2_divisions` asks for it.
#[inline]
pub fn round_size(size: u64, divisions: &[u64; 16]) -> u64 {
    if size < MIN_BLOCK_SIZE {
        return MIN_BLOCK_SIZE;
    }
    let d = divisions[division_index(size)];
    if d > 1 && size > MIN_BLOCK_SIZE.saturating_mul(d) {
        next_power2_division(size, d)
    } else {
        size.div_ceil(MIN_BLOCK_SIZE) * MIN_BLOCK_SIZE
    }
}

/// The smallest of the `divisions` equal steps between the powers of two around `size` that is
/// at least `size`; a power of two is returned unchanged.
fn next_power2_division(size: u64, divisions: u64) -> u64 {
    if size.is_power_of_two() {
        return size;
    }
    let floor = 1u64 << (63 - size.leading_zeros());
    let step = floor >> (63 - divisions.leading_zeros());
    if step == 0 {
        return floor << 1;
    }
    let down = size & !(step - 1);
    if down == size { size } else { down + step }
}

/// The size of the device segment allocated when no cached block can serve a request of
/// `rounded` bytes.
#[inline]
pub fn segment_size(rounded: u64) -> u64 {
    if rounded <= SMALL_SIZE {
        SMALL_BUFFER
    } else if rounded < MIN_LARGE_ALLOC {
        LARGE_BUFFER
    } else {
        rounded.div_ceil(ROUND_LARGE) * ROUND_LARGE
    }
}

/// Formats a byte count the way PyTorch's messages do: `512 bytes`, `1.50 KiB`, `20.00 MiB`,
/// `1.00 GiB`.
pub fn format_size(size: u64) -> String {
    if size <= 1024 {
        format!("{size} bytes")
    } else if size <= 1 << 20 {
        format!("{:.2} KiB", size as f64 / 1024.0)
    } else if size <= 1 << 30 {
        format!("{:.2} MiB", size as f64 / (1u64 << 20) as f64)
    } else {
        format!("{:.2} GiB", size as f64 / (1u64 << 30) as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const OFF: [u64; 16] = [0; 16];

    #[test]
    fn tiny_requests_round_to_one_minimum_block() {
        // Zero too, as PyTorch's round_size does (the core never asks: rule 1 answers a
        // zero-size request before rounding, but this function is public).
        assert_eq!(round_size(0, &OFF), 512);
        assert_eq!(round_size(0, &[4; 16]), 512);
        assert_eq!(round_size(1, &OFF), 512);
        assert_eq!(round_size(511, &OFF), 512);
        assert_eq!(round_size(512, &OFF), 512);
        assert_eq!(round_size(513, &OFF), 1024);
    }

    #[test]
    fn power2_divisions_round_to_the_next_step() {
        let four = [4; 16];
        // 1.2 MiB lies between 1 and 2 MiB; steps of 256 KiB; next is 1.25 MiB.
        assert_eq!(round_size(1_200 * 1024, &four), 1_280 * 1024);
        // A power of two is already on a step.
        assert_eq!(round_size(1 << 21, &four), 1 << 21);
        // Small sizes (not above 512 × divisions) keep the 512-byte rule.
        assert_eq!(round_size(1200, &four), 1536);
        // 5000 B with 4 divisions: 4096 + 1024 steps → 5120.
        assert_eq!(round_size(5000, &four), 5120);
    }

    #[test]
    fn division_intervals_start_at_one_mebibyte() {
        assert_eq!(division_index(1), 0);
        assert_eq!(division_index((1 << 21) - 1), 0);
        assert_eq!(division_index(1 << 21), 1);
        assert_eq!(division_index(1 << 40), 15);
    }

    #[test]
    fn segment_sizes_follow_the_three_classes() {
        assert_eq!(segment_size(512), SMALL_BUFFER);
        assert_eq!(segment_size(SMALL_SIZE), SMALL_BUFFER);
        assert_eq!(segment_size(SMALL_SIZE + 512), LARGE_BUFFER);
        assert_eq!(segment_size(MIN_LARGE_ALLOC - 512), LARGE_BUFFER);
        assert_eq!(segment_size(MIN_LARGE_ALLOC), MIN_LARGE_ALLOC);
        assert_eq!(segment_size(MIN_LARGE_ALLOC + 512), 12 << 20);
    }

    #[test]
    fn sizes_format_like_pytorch() {
        assert_eq!(format_size(512), "512 bytes");
        assert_eq!(format_size(1536), "1.50 KiB");
        assert_eq!(format_size(20 << 20), "20.00 MiB");
        assert_eq!(format_size(3 << 30), "3.00 GiB");
    }
}
