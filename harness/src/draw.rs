//! Drawing inputs: the one way operations, scenarios and knobs are generated.
//!
//! The one rule: every generated type is drawn by its `Arbitrary` implementation, from weighted
//! tables written once. cargo-fuzz feeds it the fuzzer's bytes; the property tests feed it
//! bytes proptest generates and shrinks ([`strategy`]), so a fuzzer and the property tests
//! explore the same space with the same weights, and a shrunk case is a shorter, smaller byte
//! string: fewer operations, each nearer the first entry of its tables.

use arbitrary::{Arbitrary, Unstructured};
use proptest::prelude::*;

/// A weighted table: `(weight, value)`.
pub type Weighted<T> = [(u32, T)];

/// A weighted table of ways to draw a value.
pub type Draws<T> = [(u32, fn(&mut Unstructured<'_>) -> arbitrary::Result<T>)];

/// One entry of `table`, each with probability proportional to its weight (the first entry
/// when the bytes run out).
pub fn weighted<T: Clone>(u: &mut Unstructured<'_>, table: &Weighted<T>) -> arbitrary::Result<T> {
    let total: u32 = table.iter().map(|(w, _)| w).sum();
    let mut r = u.int_in_range(0..=total.saturating_sub(1))?;
    for (w, v) in table {
        if r < *w {
            return Ok(v.clone());
        }
        r -= w;
    }
    Err(arbitrary::Error::EmptyChoose)
}

/// Draws with one of `table`'s ways, chosen by weight.
pub fn draw<T>(u: &mut Unstructured<'_>, table: &Draws<T>) -> arbitrary::Result<T> {
    let way = weighted(u, table)?;
    way(u)
}

/// Bytes each generated value of [`strategy`] is drawn from: enough for the largest operation
/// (an adoption of six blocks takes about 70).
pub const BYTES_PER_VALUE: usize = 96;

/// The proptest strategy of a type drawn by `Arbitrary`: [`BYTES_PER_VALUE`] random bytes,
/// decoded. Proptest shrinks the bytes towards zero, which draws the first entry of every
/// table and the low end of every range.
pub fn strategy<T>() -> impl Strategy<Value = T>
where
    T: for<'a> Arbitrary<'a> + std::fmt::Debug,
{
    proptest::collection::vec(any::<u8>(), BYTES_PER_VALUE).prop_map(|bytes| {
        T::arbitrary(&mut Unstructured::new(&bytes))
            .expect("the harness's types decode every byte string")
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weights_are_followed_and_exhausted_bytes_give_the_first_entry() {
        let table: &Weighted<u8> = &[(1, 0), (3, 1)];
        let mut counts = [0u32; 2];
        for b in 0..=255u8 {
            let v = weighted(&mut Unstructured::new(&[b]), table).unwrap();
            counts[v as usize] += 1;
        }
        assert_eq!(counts, [64, 192]);
        assert_eq!(weighted(&mut Unstructured::new(&[]), table).unwrap(), 0);
    }
}
