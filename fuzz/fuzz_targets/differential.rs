//! Allocator vs model: the scenario the bytes decode to must agree step by step and end empty.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    if let Err(e) = cachalot_harness::fuzzing::differential(data) {
        panic!("{e}");
    }
});
