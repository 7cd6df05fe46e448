//! The allocator under injected device faults: clean errors, no lost block, normal work after.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    if let Err(e) = cachalot_harness::fuzzing::device_faults(data) {
        panic!("{e}");
    }
});
