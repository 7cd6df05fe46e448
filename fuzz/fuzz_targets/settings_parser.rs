//! PYTORCH_CUDA_ALLOC_CONF parser: settings or a clean error; printed settings parse back equal.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    if let Err(e) = cachalot_harness::fuzzing::settings_parser(data) {
        panic!("{e}");
    }
});
