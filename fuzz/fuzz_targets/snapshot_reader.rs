//! PyTorch snapshot reader: bytes give a snapshot (that writes back the same) or a clean error.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    if let Err(e) = cachalot_harness::fuzzing::snapshot_reader(data) {
        panic!("{e}");
    }
});
