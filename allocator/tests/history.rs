//! The history recorder's switch on the front end (`Allocator::record_history`): `Some(n)`
//! with n > 0 records, `Some(0)` and `None` stop. Guards the mutant that turned the `n > 0`
//! filter into `n < 0` (never recording), which only the doc test caught before.
#![cfg(not(loom))]

use cachalot::{Allocator, Settings, SimDevice, StreamId};

#[test]
fn record_history_some_positive_records_and_zero_or_none_stops() {
    let alloc = Allocator::new(SimDevice::new(1 << 30), Settings::default()).unwrap();
    alloc.record_history(Some(100_000));
    let p = alloc.malloc(4096, StreamId(0)).unwrap();
    alloc.free(p).unwrap();
    let recorded = alloc.history().len();
    assert!(
        recorded >= 2,
        "a malloc and a free while recording left {recorded} entries"
    );
    alloc.record_history(Some(0));
    assert!(
        alloc.history().is_empty(),
        "Some(0) must stop recording and clear the history"
    );
    let q = alloc.malloc(4096, StreamId(0)).unwrap();
    alloc.free(q).unwrap();
    assert!(
        alloc.history().is_empty(),
        "nothing is recorded after Some(0)"
    );
    alloc.record_history(Some(10));
    alloc.record_history(None);
    assert!(alloc.history().is_empty());
}
