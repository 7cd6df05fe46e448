//! The size rules: rounding a request (rule 2), choosing its pool (rule 3), sizing a new
//! segment (rule 4) and deciding whether a found block is split (rule 13).
//!
//! These are pure functions of sizes and settings; everything that touches state lives in the
//! policy modules.

/// The smallest block, and the granularity of every block size (512 B).
pub(crate) const MIN_BLOCK_SIZE: u64 = 512;
/// The largest request that is served from the small pool (1 MiB).
pub(crate) const SMALL_SIZE: u64 = 1 << 20;
/// The size of every small-pool segment (2 MiB).
pub(crate) const SMALL_BUFFER: u64 = 2 << 20;
/// Large requests below this size get a [`LARGE_BUFFER`] segment (10 MiB).
pub(crate) const MIN_LARGE_ALLOC: u64 = 10 << 20;
/// Larger segments are rounded up to a multiple of this (2 MiB).
pub(crate) const ROUND_LARGE: u64 = 2 << 20;
/// The segment size for large requests below [`MIN_LARGE_ALLOC`] (20 MiB).
pub(crate) const LARGE_BUFFER: u64 = 20 << 20;

/// Which of the two block pools a request, a segment or a block belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Pool {
    /// Rounded requests of at most 1 MiB, served from 2 MiB segments.
    Small,
    /// Everything else.
    Large,
}

/// `floor(log2 x)` for `x > 0`.
fn floor_log2(x: u64) -> u32 {
    63 - x.leading_zeros()
}

/// `x` rounded up to a multiple of `step` (`step > 0`).
fn round_up(x: u64, step: u64) -> u64 {
    x.div_ceil(step) * step
}

/// Rule 2: the size a request of `size` bytes (`size > 0`) is rounded to.
pub(crate) fn round_size(size: u64, roundup_power2_divisions: &[u64; 16]) -> u64 {
    if size < MIN_BLOCK_SIZE {
        return MIN_BLOCK_SIZE;
    }
    // i = clamp(floor(log2 size) − 20, 0, 15)
    let index = (i64::from(floor_log2(size)) - 20).clamp(0, 15) as usize;
    let divisions = roundup_power2_divisions[index];
    // `size > 512·d`, computed without overflow.
    if divisions > 1 && u128::from(size) > u128::from(MIN_BLOCK_SIZE) * u128::from(divisions) {
        if size.is_power_of_two() {
            return size;
        }
        let floor_power = 1u64 << floor_log2(size);
        let step = floor_power >> floor_log2(divisions);
        if step == 0 {
            return floor_power * 2;
        }
        return round_up(size, step);
    }
    round_up(size, MIN_BLOCK_SIZE)
}

/// Rule 3: the pool of a rounded size.
pub(crate) fn pool_for(rounded: u64) -> Pool {
    if rounded <= SMALL_SIZE {
        Pool::Small
    } else {
        Pool::Large
    }
}

/// Rule 4: the size of the device allocation made for a rounded size.
pub(crate) fn segment_size(rounded: u64) -> u64 {
    if pool_for(rounded) == Pool::Small {
        SMALL_BUFFER
    } else if rounded < MIN_LARGE_ALLOC {
        LARGE_BUFFER
    } else {
        round_up(rounded, ROUND_LARGE)
    }
}

/// Rule 13: whether a found block of `block_size` bytes is split to serve a request rounded
/// to `rounded` bytes (`rounded ≤ block_size`).
pub(crate) fn should_split(pool: Pool, block_size: u64, rounded: u64, max_split_size: u64) -> bool {
    let remaining = block_size - rounded;
    match pool {
        Pool::Small => remaining >= MIN_BLOCK_SIZE,
        Pool::Large => rounded < max_split_size && remaining > SMALL_SIZE,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KIB: u64 = 1 << 10;
    const MIB: u64 = 1 << 20;
    const OFF: [u64; 16] = [0; 16];

    fn divisions(d: u64) -> [u64; 16] {
        [d; 16]
    }

    #[test]
    fn requests_below_512_bytes_round_to_512() {
        assert_eq!(round_size(1, &OFF), 512);
        assert_eq!(round_size(511, &OFF), 512);
        assert_eq!(round_size(512, &OFF), 512);
    }

    #[test]
    fn requests_round_up_to_a_multiple_of_512_without_divisions() {
        assert_eq!(round_size(513, &OFF), 1024);
        assert_eq!(round_size(1200, &OFF), 1536);
        assert_eq!(round_size(MIB + 1, &OFF), MIB + 512);
        assert_eq!(round_size(1 << 60, &OFF), 1 << 60);
    }

    #[test]
    fn small_sizes_are_not_affected_by_divisions() {
        // 1200 ≤ 512·4, so the plain 512 rounding applies.
        assert_eq!(round_size(1200, &divisions(4)), 1536);
        assert_eq!(round_size(2048, &divisions(4)), 2048);
    }

    #[test]
    fn divisions_round_up_to_the_next_division_of_the_power_of_two_interval() {
        // 1.2 MiB with 4 divisions of [1 MiB, 2 MiB): steps of 256 KiB.
        let size = 12 * MIB / 10;
        assert_eq!(round_size(size, &divisions(4)), MIB + 256 * KIB);
        // Exactly on a division: unchanged.
        assert_eq!(round_size(MIB + 512 * KIB, &divisions(4)), MIB + 512 * KIB);
        // A power of two stays.
        assert_eq!(round_size(4 * MIB, &divisions(4)), 4 * MIB);
        // 5 MiB + 1 with 2 divisions of [4 MiB, 8 MiB): steps of 2 MiB.
        assert_eq!(round_size(5 * MIB + 1, &divisions(2)), 6 * MIB);
    }

    #[test]
    fn divisions_use_the_interval_of_the_size_clamped_to_sixteen_entries() {
        let mut table = OFF;
        table[0] = 8; // sizes below 2 MiB (including sizes below 1 MiB)
        table[15] = 2; // sizes of 32 GiB and more
        assert_eq!(round_size(300 * KIB + 1, &table), 320 * KIB);
        assert_eq!(round_size(3 * MIB + 1, &table), 3 * MIB + 512);
        assert_eq!(round_size((1 << 40) + 1, &table), 3 << 39);
    }

    #[test]
    fn a_single_division_means_no_power_of_two_rounding() {
        assert_eq!(
            round_size(12 * MIB / 10, &divisions(1)),
            round_size(12 * MIB / 10, &OFF)
        );
    }

    #[test]
    fn one_mebibyte_is_the_largest_small_request() {
        assert_eq!(pool_for(512), Pool::Small);
        assert_eq!(pool_for(MIB), Pool::Small);
        assert_eq!(pool_for(MIB + 512), Pool::Large);
    }

    #[test]
    fn segment_sizes_follow_the_pool_and_the_ten_mebibyte_threshold() {
        assert_eq!(segment_size(512), 2 * MIB);
        assert_eq!(segment_size(MIB), 2 * MIB);
        assert_eq!(segment_size(MIB + 512), 20 * MIB);
        assert_eq!(segment_size(10 * MIB - 512), 20 * MIB);
        assert_eq!(segment_size(10 * MIB), 10 * MIB);
        assert_eq!(segment_size(10 * MIB + 1), 12 * MIB);
        assert_eq!(segment_size(1 << 30), 1 << 30);
    }

    #[test]
    fn small_blocks_split_when_at_least_512_bytes_remain() {
        assert!(should_split(Pool::Small, 2 * MIB, 2 * MIB - 512, u64::MAX));
        assert!(!should_split(Pool::Small, 2 * MIB, 2 * MIB, u64::MAX));
    }

    #[test]
    fn large_blocks_split_when_more_than_one_mebibyte_remains_below_max_split_size() {
        assert!(should_split(Pool::Large, 20 * MIB, 18 * MIB, u64::MAX));
        assert!(!should_split(Pool::Large, 20 * MIB, 19 * MIB, u64::MAX));
        assert!(should_split(
            Pool::Large,
            20 * MIB,
            19 * MIB - 512,
            u64::MAX
        ));
        // A request at or above max_split_size never splits.
        assert!(!should_split(Pool::Large, 64 * MIB, 30 * MIB, 30 * MIB));
        assert!(should_split(Pool::Large, 64 * MIB, 30 * MIB, 30 * MIB + 1));
    }
}
