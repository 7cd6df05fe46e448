//! The settings' tests: the parser against PyTorch's behaviour, the printer's round trip, and
//! the setters.

use super::*;
use proptest::prelude::*;

const MB: u64 = 1 << 20;

fn parse(s: &str) -> Settings {
    match Settings::parse(s) {
        Ok(settings) => settings,
        Err(e) => panic!("{s:?} should parse, got: {e}"),
    }
}

fn err(s: &str) -> SettingsError {
    match Settings::parse(s) {
        Ok(settings) => panic!("{s:?} should be refused, parsed to {settings:?}"),
        Err(e) => e,
    }
}

/// Asserts that `s` is refused as an invalid value for `key` with `reason`.
#[track_caller]
fn assert_invalid(s: &str, key: &str, value: &str, reason: &str) {
    assert_eq!(
        err(s),
        SettingsError::InvalidValue {
            key: key.into(),
            value: value.into(),
            reason: reason.into()
        },
        "for {s:?}"
    );
}

/// Asserts that `s` is refused as a syntax error in `key` whose reason contains `reason`.
#[track_caller]
fn assert_syntax(s: &str, key: Option<&str>, reason: &str) {
    match err(s) {
        SettingsError::Syntax {
            key: k, reason: r, ..
        } => {
            assert_eq!(k.as_deref(), key, "key for {s:?}");
            assert!(r.contains(reason), "reason {r:?} for {s:?}");
        }
        e => panic!("{s:?}: expected a syntax error, got {e:?}"),
    }
}

fn divisions(entries: &[(std::ops::RangeInclusive<usize>, u64)]) -> [u64; 16] {
    let mut t = [0; 16];
    for (range, d) in entries {
        for i in range.clone() {
            t[i] = *d;
        }
    }
    t
}

// --- defaults -----------------------------------------------------------------------------

#[test]
fn pytorch_defaults_are_those_of_pytorch_2() {
    let d = Settings::pytorch();
    assert_eq!(d.max_split_size, u64::MAX);
    assert_eq!(d.max_non_split_rounding_size, 20 * MB);
    assert_eq!(d.garbage_collection_threshold, 0.0);
    assert_eq!(d.roundup_power2_divisions, [0; 16]);
    assert!(!d.expandable_segments);
    assert_eq!(d.per_process_memory_fraction, None);
    assert_eq!(d.backend, AllocatorBackend::Native);
}

#[test]
fn cachalot_defaults_are_pytorchs_plus_thread_caches_expandable_2_mib_pages_reclaim_and_stitching()
{
    // Rule 21. Display compares the keys where the two defaults differ with cachalot's (parse
    // starts from cachalot's), every other key with PyTorch's.
    assert_eq!(Settings::default(), Settings::cachalot());
    assert_eq!(
        Settings::cachalot(),
        Settings {
            thread_cache_blocks: THREAD_CACHE_BLOCKS,
            expandable_segments: true,
            expandable_page_size: 2 * MB,
            reclaim_headroom: Some(0.025),
            page_stitching: true,
            ..Settings::pytorch()
        }
    );
    assert!(!Settings::pytorch().page_stitching);
    assert_eq!(Settings::pytorch().thread_cache_blocks, 0);
    assert!(!Settings::pytorch().page_aliasing);
    assert_eq!(Settings::pytorch().expandable_page_size, 20 * MB);
    assert_eq!(Settings::pytorch().reclaim_headroom, None);
    assert_eq!(
        Settings::pytorch().to_string(),
        "expandable_segments:False,expandable_page_mb:20,reclaim_headroom:off,thread_cache_blocks:0"
    );
    assert_eq!(
        Settings::parse(&Settings::pytorch().to_string()),
        Ok(Settings::pytorch())
    );
}

#[test]
fn expandable_page_mb_takes_even_mib_from_2_to_1024() {
    assert_eq!(parse("expandable_page_mb:20").expandable_page_size, 20 * MB);
    assert_eq!(parse("expandable_page_mb:2").expandable_page_size, 2 * MB);
    assert_eq!(
        parse("expandable_page_mb:1024").expandable_page_size,
        1024 * MB
    );
    for bad in ["0", "1", "3", "1026", "2048", "-2", "2.0"] {
        assert!(
            Settings::parse(&format!("expandable_page_mb:{bad}")).is_err(),
            "{bad} accepted"
        );
    }
}

#[test]
fn reclaim_headroom_takes_a_fraction_or_off() {
    assert_eq!(parse("reclaim_headroom:0.1").reclaim_headroom, Some(0.1));
    assert_eq!(parse("reclaim_headroom:0").reclaim_headroom, Some(0.0));
    assert_eq!(parse("reclaim_headroom:off").reclaim_headroom, None);
    for bad in ["1.5", "-0.1", "nan", "Off", "none", ""] {
        assert!(
            Settings::parse(&format!("reclaim_headroom:{bad}")).is_err(),
            "{bad} accepted"
        );
    }
}

#[test]
fn page_aliasing_is_read_as_a_boolean_over_expandable_segments() {
    // Rule 22: off in cachalot's defaults and in PyTorch's, spelled True or False.
    assert!(!parse("").page_aliasing);
    assert!(parse("page_aliasing:True").page_aliasing);
    assert!(!parse("page_aliasing:False").page_aliasing);
    assert!(parse("page_aliasing:False,page_aliasing:True").page_aliasing);
    let over_pytorch = |s: &str| Settings::pytorch().apply(s);
    let s = over_pytorch("expandable_segments:True,page_aliasing:True").unwrap();
    assert!(s.page_aliasing && s.expandable_segments);
    // The check is made once the whole string is applied: the order of the keys is free.
    assert_eq!(
        over_pytorch("page_aliasing:True,expandable_segments:True"),
        Ok(s)
    );
    for bad in ["true", "1", "on", "TRUE", ""] {
        assert!(
            Settings::parse(&format!("page_aliasing:{bad}")).is_err(),
            "{bad} accepted"
        );
    }
}

#[test]
fn page_aliasing_without_expandable_segments_is_refused() {
    let reason = "page aliasing needs expandable_segments:True (it maps pages of expandable \
                  segments' ranges a second time)";
    for s in [
        "expandable_segments:False,page_aliasing:True",
        "page_aliasing:True,expandable_segments:False",
        "page_aliasing:False,page_aliasing:True,expandable_segments:False",
    ] {
        assert_invalid(s, "page_aliasing", "True", reason);
    }
    // Over PyTorch's defaults expandable segments are off: asking for aliasing alone is refused.
    assert_eq!(
        Settings::pytorch().apply("page_aliasing:True").unwrap_err(),
        SettingsError::InvalidValue {
            key: "page_aliasing".into(),
            value: "True".into(),
            reason: reason.into(),
        }
    );
    let e = err("expandable_segments:False,page_aliasing:True").to_string();
    assert!(
        e.contains("page_aliasing") && e.contains("expandable_segments:True"),
        "{e}"
    );
}

#[test]
fn turning_expandable_segments_off_turns_the_aliasing_it_inherited_off() {
    // Settings with both on; a string that turns expandable segments off without naming
    // page_aliasing gives settings without aliasing, not a refusal.
    let both = parse("page_aliasing:True");
    let parse = |t: &str| both.apply(t).unwrap();
    let s = parse("expandable_segments:False");
    assert!(!s.expandable_segments && !s.page_aliasing);
    assert_eq!(
        parse("expandable_segments:False,page_aliasing:False"),
        s.clone()
    );
    // Turned on again in the same string, the inherited value stands.
    assert!(parse("expandable_segments:False,expandable_segments:True").page_aliasing);
    // Applied over settings without expandable segments, nothing brings aliasing back.
    assert!(!s.apply("max_split_size_mb:64").unwrap().page_aliasing);
    assert!(!s.apply("expandable_segments:True").unwrap().page_aliasing);
}

#[test]
fn empty_and_blank_strings_give_the_defaults() {
    for s in ["", " ", "   ", "\t\n \r"] {
        assert_eq!(parse(s), Settings::default(), "for {s:?}");
    }
}

// --- PyTorch's documented examples ------------------------------------------------------

#[test]
fn max_split_size_mb_is_stored_in_bytes() {
    assert_eq!(parse("max_split_size_mb:128").max_split_size, 128 * MB);
    assert_eq!(parse("max_split_size_mb:20").max_split_size, 20 * MB);
}

#[test]
fn the_tuning_guide_example_sets_both_keys() {
    let s = parse("garbage_collection_threshold:0.6,max_split_size_mb:128");
    assert_eq!(s.garbage_collection_threshold, 0.6);
    assert_eq!(s.max_split_size, 128 * MB);
    assert_eq!(
        s,
        Settings {
            garbage_collection_threshold: 0.6,
            max_split_size: 128 * MB,
            ..Settings::cachalot()
        }
    );
}

#[test]
fn max_non_split_rounding_mb_is_stored_in_bytes() {
    assert_eq!(
        parse("max_non_split_rounding_mb:1024").max_non_split_rounding_size,
        1024 * MB
    );
}

#[test]
fn a_single_division_count_applies_to_every_interval() {
    assert_eq!(
        parse("roundup_power2_divisions:4").roundup_power2_divisions,
        [4; 16]
    );
}

#[test]
fn the_documented_division_list_fills_below_the_first_entry_and_after_the_last() {
    // 0..=8 (sizes below 512 MiB) get 1, 9 gets 2, 10 gets 4 and '>' fills 11..=15.
    let s = parse("roundup_power2_divisions:[256:1,512:2,1024:4,>:8]");
    assert_eq!(
        s.roundup_power2_divisions,
        divisions(&[(0..=8, 1), (9..=9, 2), (10..=10, 4), (11..=15, 8)])
    );
    assert_eq!(s.roundup_divisions_for(100 * MB), 1);
    assert_eq!(s.roundup_divisions_for(300 * MB), 1);
    assert_eq!(s.roundup_divisions_for(600 * MB), 2);
    assert_eq!(s.roundup_divisions_for(1024 * MB), 4);
    assert_eq!(s.roundup_divisions_for(2048 * MB), 8);
}

#[test]
fn pytorchs_own_unit_test_lists_give_its_expected_divisions() {
    // c10/test/core/AllocatorConfig_test.cpp
    let s = parse("roundup_power2_divisions:[64:8,128:2,256:4,512:2,1024:4,>:1]");
    for (mb, d) in [
        (32, 8),
        (64, 8),
        (128, 2),
        (256, 4),
        (512, 2),
        (1024, 4),
        (2048, 1),
        (4096, 1),
        (8192, 1),
    ] {
        assert_eq!(s.roundup_divisions_for(mb * MB), d, "{mb} MB");
    }
    // An interval no entry reaches keeps its previous value (here 0), not its neighbour's.
    let s = parse("roundup_power2_divisions:[128:8,256:16,512:1,2048:8,>:2]");
    for (mb, d) in [
        (64, 8),
        (128, 8),
        (256, 16),
        (512, 1),
        (1024, 0),
        (2048, 8),
        (4096, 2),
    ] {
        assert_eq!(s.roundup_divisions_for(mb * MB), d, "{mb} MB");
    }
}

#[test]
fn division_list_keys_are_clamped_to_the_sixteen_intervals() {
    // 1 MB is interval 0; 2^20 MB (beyond 64 GiB) clamps to 15.
    let s = parse("roundup_power2_divisions:[1:2,1048576:4]");
    assert_eq!(
        s.roundup_power2_divisions,
        divisions(&[(0..=0, 2), (15..=15, 4)])
    );
}

#[test]
fn a_leading_greater_than_entry_fills_after_interval_zero_only() {
    let s = parse("roundup_power2_divisions:[>:8]");
    assert_eq!(s.roundup_power2_divisions, divisions(&[(1..=15, 8)]));
    // '>' does not count as the first value: a later numeric entry still fills below.
    let s = parse("roundup_power2_divisions:[>:8,256:1]");
    assert_eq!(
        s.roundup_power2_divisions,
        divisions(&[(0..=8, 1), (9..=15, 8)])
    );
}

#[test]
fn zero_divisions_are_allowed_in_the_list_form() {
    let s = parse("roundup_power2_divisions:[256:0,>:4]");
    assert_eq!(s.roundup_power2_divisions, divisions(&[(9..=15, 4)]));
}

#[test]
fn boolean_keys_and_the_backend_are_read() {
    let s = parse("expandable_segments:True,backend:cudaMallocAsync");
    assert!(s.expandable_segments);
    assert_eq!(s.backend, AllocatorBackend::CudaMallocAsync);
    let s = s
        .apply("expandable_segments:False,backend:native")
        .expect("valid");
    assert!(!s.expandable_segments);
    assert_eq!(s.backend, AllocatorBackend::Native);
}

#[test]
fn per_process_memory_fraction_accepts_both_ends() {
    assert_eq!(
        parse("per_process_memory_fraction:0").per_process_memory_fraction,
        Some(0.0)
    );
    assert_eq!(
        parse("per_process_memory_fraction:1").per_process_memory_fraction,
        Some(1.0)
    );
    assert_eq!(
        parse("per_process_memory_fraction:0.92").per_process_memory_fraction,
        Some(0.92)
    );
}

#[test]
fn white_space_is_dropped_even_inside_words() {
    let s = parse(" max_split_size_mb : 2 0 ,\texpandable_segments:\nTrue ");
    assert_eq!(s.max_split_size, 20 * MB);
    assert!(s.expandable_segments);
}

#[test]
fn a_repeated_key_takes_its_last_value() {
    assert_eq!(
        parse("max_split_size_mb:100,max_split_size_mb:200").max_split_size,
        200 * MB
    );
}

#[test]
fn huge_split_sizes_are_clamped_to_the_largest_whole_mebibyte_count() {
    let s = parse("max_split_size_mb:18446744073709551615");
    assert_eq!(s.max_split_size, (u64::MAX / MB) * MB);
    assert_ne!(s.max_split_size, u64::MAX);
}

#[test]
fn decimal_forms_with_exponents_and_bare_points_are_accepted() {
    assert_eq!(
        parse("garbage_collection_threshold:5e-1").garbage_collection_threshold,
        0.5
    );
    assert_eq!(
        parse("garbage_collection_threshold:.25").garbage_collection_threshold,
        0.25
    );
    assert_eq!(
        parse("per_process_memory_fraction:1.").per_process_memory_fraction,
        Some(1.0)
    );
}

// --- apply -----------------------------------------------------------------------------

#[test]
fn apply_keeps_what_the_string_does_not_mention() {
    let base = parse("max_split_size_mb:64,roundup_power2_divisions:4,expandable_segments:False");
    let s = base.apply("expandable_segments:True").expect("valid");
    assert_eq!(s.max_split_size, 64 * MB);
    assert_eq!(s.roundup_power2_divisions, [4; 16]);
    assert!(s.expandable_segments);
    // The list form is layered over the current table.
    let s = base
        .apply("roundup_power2_divisions:[256:1]")
        .expect("valid");
    assert_eq!(
        s.roundup_power2_divisions,
        divisions(&[(0..=8, 1), (9..=15, 4)])
    );
    // Nothing is applied when the string is refused.
    assert!(base.apply("expandable_segments:True,bogus:1").is_err());
    assert!(!base.expandable_segments);
}

// --- errors: values ---------------------------------------------------------------------

#[test]
fn split_sizes_below_twenty_megabytes_are_refused() {
    for key in ["max_split_size_mb", "max_non_split_rounding_mb"] {
        assert_invalid(&format!("{key}:19"), key, "19", "too small, must be >= 20");
        assert_invalid(&format!("{key}:0"), key, "0", "too small, must be >= 20");
    }
}

#[test]
fn integers_must_be_plain_digits_that_fit_in_64_bits() {
    let key = "max_split_size_mb";
    for bad in ["12abc", "-1", "+30", "0x20", "1e3", "30.0", "abc"] {
        assert_invalid(
            &format!("{key}:{bad}"),
            key,
            bad,
            "expected a non-negative integer",
        );
    }
    assert_invalid(
        "max_split_size_mb:18446744073709551616",
        key,
        "18446744073709551616",
        "too large, does not fit in 64 bits",
    );
    assert_invalid(
        "pinned_num_register_threads:4x",
        "pinned_num_register_threads",
        "4x",
        "expected a non-negative integer",
    );
}

#[test]
fn garbage_collection_threshold_must_be_strictly_between_zero_and_one() {
    let key = "garbage_collection_threshold";
    for bad in ["0.0", "0", "1.0", "1", "1.5", "-0.1", "1e999"] {
        let reason = if bad == "1e999" {
            "out of range"
        } else {
            "must be in (0.0, 1.0)"
        };
        assert_invalid(&format!("{key}:{bad}"), key, bad, reason);
    }
    for bad in [
        "nan", "NaN", "inf", "-inf", "infinity", "0x1p-1", "0.5abc", "e5", ".", "5e",
    ] {
        assert_invalid(
            &format!("{key}:{bad}"),
            key,
            bad,
            "expected a decimal number",
        );
    }
}

#[test]
fn per_process_memory_fraction_must_be_within_zero_and_one() {
    let key = "per_process_memory_fraction";
    for bad in ["1.01", "-0.01", "2"] {
        assert_invalid(&format!("{key}:{bad}"), key, bad, "must be in [0.0, 1.0]");
    }
    assert_invalid(
        &format!("{key}:nan"),
        key,
        "nan",
        "expected a decimal number",
    );
}

#[test]
fn a_single_division_count_must_be_a_power_of_two() {
    let key = "roundup_power2_divisions";
    for bad in ["0", "3", "6"] {
        assert_invalid(&format!("{key}:{bad}"), key, bad, "must be a power of two");
    }
}

#[test]
fn division_list_entries_are_checked() {
    let key = "roundup_power2_divisions";
    assert_invalid(
        "roundup_power2_divisions:[3:1]",
        key,
        "3",
        "an interval size (in MB) must be a power of two",
    );
    assert_invalid(
        "roundup_power2_divisions:[0:1]",
        key,
        "0",
        "an interval size (in MB) must be a power of two",
    );
    assert_invalid(
        "roundup_power2_divisions:[abc:1]",
        key,
        "abc",
        "an interval must be a size in MB or '>'",
    );
    assert_invalid(
        "roundup_power2_divisions:[>>:1]",
        key,
        ">>",
        "an interval must be a size in MB or '>'",
    );
    assert_invalid(
        "roundup_power2_divisions:[256:3]",
        key,
        "3",
        "the number of divisions must be 0 or a power of two",
    );
    assert_invalid(
        "roundup_power2_divisions:[256:1x]",
        key,
        "1x",
        "expected a non-negative integer",
    );
    assert_invalid(
        "roundup_power2_divisions:[99999999999999999999:1]",
        key,
        "99999999999999999999",
        "too large, does not fit in 64 bits",
    );
    assert_invalid(
        "roundup_power2_divisions:[]",
        key,
        "[]",
        "the list is empty",
    );
}

#[test]
fn booleans_are_spelled_exactly_true_or_false() {
    for key in [
        "expandable_segments",
        "release_lock_on_cudamalloc",
        "pinned_use_cuda_host_register",
        "pinned_use_background_threads",
    ] {
        for bad in ["true", "1", "yes", "FALSE"] {
            assert_invalid(&format!("{key}:{bad}"), key, bad, "expected True or False");
        }
    }
}

#[test]
fn register_threads_must_be_a_power_of_two_up_to_128() {
    let key = "pinned_num_register_threads";
    assert_invalid(&format!("{key}:3"), key, "3", "must be a power of two");
    assert_invalid(&format!("{key}:0"), key, "0", "must be a power of two");
    assert_invalid(&format!("{key}:256"), key, "256", "must be <= 128");
    // A valid count other than the default is checked first, then refused as unsupported.
    assert!(matches!(
        err("pinned_num_register_threads:128"),
        SettingsError::Unsupported { .. }
    ));
}

// --- keys cachalot refuses ----------------------------------------------------------------

#[test]
fn refused_keys_are_accepted_at_their_default_value_and_change_nothing() {
    let s = parse(
        "release_lock_on_cudamalloc:False,pinned_use_cuda_host_register:False,\
         pinned_num_register_threads:1,pinned_use_background_threads:False",
    );
    assert_eq!(s, Settings::default());
    assert_eq!(s.to_string(), "");
    let base = parse("max_split_size_mb:64");
    assert_eq!(
        base.apply("pinned_num_register_threads:1"),
        Ok(base.clone())
    );
}

#[test]
fn refused_keys_with_any_other_value_are_unsupported_and_say_why() {
    for (setting, key, says) in [
        (
            "release_lock_on_cudamalloc:True",
            "release_lock_on_cudamalloc",
            "release the allocator's lock around each cudaMalloc",
        ),
        (
            "pinned_use_cuda_host_register:True",
            "pinned_use_cuda_host_register",
            "pinned host memory is not its business",
        ),
        (
            "pinned_num_register_threads:8",
            "pinned_num_register_threads",
            "pinned host memory is not its business",
        ),
        (
            "pinned_use_background_threads:True",
            "pinned_use_background_threads",
            "pinned host memory is not its business",
        ),
    ] {
        let e = err(&format!("max_split_size_mb:64,{setting}"));
        let SettingsError::Unsupported { key: k, reason } = &e else {
            panic!("{setting}: expected Unsupported, got {e:?}");
        };
        assert_eq!(k, key);
        assert!(reason.contains(says), "{setting}: {reason}");
        assert!(
            reason.contains("the default) is accepted"),
            "{setting}: {reason}"
        );
        let message = e.to_string();
        assert!(
            message.starts_with(&format!("unsupported setting {key}: ")),
            "{message}"
        );
    }
}

#[test]
fn the_backend_is_native_or_cuda_malloc_async() {
    for bad in ["cudamallocasync", "hipMallocAsync", "async", "Native"] {
        assert_invalid(
            &format!("backend:{bad}"),
            "backend",
            bad,
            "expected native or cudaMallocAsync",
        );
    }
}

#[test]
fn a_list_is_refused_for_keys_other_than_the_divisions() {
    assert_invalid(
        "max_split_size_mb:[20]",
        "max_split_size_mb",
        "[",
        "a list is only accepted by roundup_power2_divisions",
    );
}

// --- errors: keys and syntax ----------------------------------------------------------

#[test]
fn unknown_keys_are_refused_by_name() {
    for key in [
        "foo",
        "max_split_size",
        "Max_split_size_mb",
        "release_lock_on_hipmalloc",
        "large_segment_size_mb",
        "max_split_size_mb20",
    ] {
        assert_eq!(
            err(&format!("{key}:1")),
            SettingsError::UnknownKey { key: key.into() }
        );
    }
    // "max_split_size_mb 20" lexes as one word.
    assert_eq!(
        err("max_split_size_mb 20"),
        SettingsError::UnknownKey {
            key: "max_split_size_mb20".into()
        }
    );
    // A later unknown key is found after valid ones.
    assert_eq!(
        err("max_split_size_mb:20,garbage:1"),
        SettingsError::UnknownKey {
            key: "garbage".into()
        }
    );
}

#[test]
fn empty_values_are_refused_as_missing() {
    for s in [
        "max_split_size_mb:",
        "max_split_size_mb:,expandable_segments:True",
        "expandable_segments:",
        "roundup_power2_divisions:",
        "backend: ",
    ] {
        let key = s.split(':').next().unwrap_or_default();
        assert_eq!(
            err(s),
            SettingsError::MissingValue { key: key.into() },
            "for {s:?}"
        );
    }
}

#[test]
fn a_key_without_a_colon_is_a_syntax_error() {
    assert_syntax(
        "max_split_size_mb",
        Some("max_split_size_mb"),
        "expected ':'",
    );
    assert_syntax(
        "expandable_segments,True",
        Some("expandable_segments"),
        "expected ':'",
    );
    assert_syntax("backend[native]", Some("backend"), "expected ':'");
    assert_syntax(
        "max_split_size_mb::20",
        Some("max_split_size_mb"),
        "expected a value",
    );
}

#[test]
fn stray_commas_are_syntax_errors() {
    assert_syntax(
        "max_split_size_mb:20,",
        None,
        "expected an option name after ','",
    );
    assert_syntax(",max_split_size_mb:20", None, "expected an option name");
    assert_syntax(
        "max_split_size_mb:20,,expandable_segments:True",
        None,
        "expected an option name",
    );
    assert_syntax(",", None, "expected an option name");
    assert_syntax(":", None, "expected an option name");
    assert_syntax("]", None, "expected an option name");
}

#[test]
fn a_value_must_be_followed_by_a_comma_or_the_end() {
    assert_syntax(
        "max_split_size_mb:20:30",
        Some("max_split_size_mb"),
        "expected ','",
    );
    assert_syntax(
        "roundup_power2_divisions:[256:1]]",
        Some("roundup_power2_divisions"),
        "expected ','",
    );
    assert_syntax(
        "roundup_power2_divisions:4[",
        Some("roundup_power2_divisions"),
        "expected ','",
    );
}

#[test]
fn malformed_division_lists_are_syntax_errors() {
    let key = Some("roundup_power2_divisions");
    for (s, reason) in [
        ("roundup_power2_divisions:[", "unclosed '['"),
        ("roundup_power2_divisions:[256:1", "unclosed '['"),
        ("roundup_power2_divisions:[256:1,", "unclosed '['"),
        ("roundup_power2_divisions:[256:1,]", "trailing ','"),
        ("roundup_power2_divisions:[256]", "expected ':'"),
        (
            "roundup_power2_divisions:[256:]",
            "expected the number of divisions",
        ),
        ("roundup_power2_divisions:[256:1:2]", "expected ',' or ']'"),
        (
            "roundup_power2_divisions:[[256:1]]",
            "expected an interval size",
        ),
        (
            "roundup_power2_divisions:[,256:1]",
            "expected an interval size",
        ),
        (
            "roundup_power2_divisions:[256:[1]]",
            "expected the number of divisions",
        ),
    ] {
        assert_syntax(s, key, reason);
    }
}

#[test]
fn a_missing_comma_in_a_list_glues_the_words_together_as_in_pytorch() {
    // White space is dropped inside words, so "1 512" is the word "1512".
    assert_invalid(
        "roundup_power2_divisions:[256:1 512:2]",
        "roundup_power2_divisions",
        "1512",
        "the number of divisions must be 0 or a power of two",
    );
}

#[test]
fn syntax_errors_say_where_they_are() {
    match err("max_split_size_mb:20;x") {
        SettingsError::UnknownKey { .. } | SettingsError::InvalidValue { .. } => {}
        e => panic!("unexpected {e:?}"),
    }
    match err("max_split_size_mb:20 ,") {
        SettingsError::Syntax { near, .. } => assert_eq!(near, "end of input"),
        e => panic!("unexpected {e:?}"),
    }
    match err("max_split_size_mb:20,]") {
        SettingsError::Syntax { near, .. } => assert_eq!(near, "\"]\" at byte 21"),
        e => panic!("unexpected {e:?}"),
    }
}

#[test]
fn error_messages_name_the_key_and_the_reason() {
    assert_eq!(
        err("garbage_collection_threshold:0.0").to_string(),
        "invalid value \"0.0\" for garbage_collection_threshold: must be in (0.0, 1.0)"
    );
    assert_eq!(err("foo:1").to_string(), "unrecognized option \"foo\"");
    assert_eq!(err("backend:").to_string(), "missing value for backend");
    assert_eq!(
        err("max_split_size_mb").to_string(),
        "syntax error in max_split_size_mb near end of input: \
         expected ':' after the option name"
    );
    assert_eq!(
        err(",").to_string(),
        "syntax error near \",\" at byte 0: expected an option name"
    );
}

// --- setters ---------------------------------------------------------------------------

#[test]
fn setters_accept_what_the_string_form_accepts() {
    let mut s = Settings::default();
    s.set_max_split_size_mb(64).expect("valid");
    s.set_garbage_collection_threshold(0.8).expect("valid");
    s.set_per_process_memory_fraction(0.5).expect("valid");
    s.set_roundup_power2_divisions(8).expect("valid");
    assert_eq!(
        s,
        parse(
            "max_split_size_mb:64,garbage_collection_threshold:0.8,\
             per_process_memory_fraction:0.5,roundup_power2_divisions:8"
        )
    );
    s.set_max_split_size_mb(u64::MAX).expect("valid");
    assert_eq!(s.max_split_size, (u64::MAX / MB) * MB);
}

#[test]
fn setters_refuse_what_the_string_form_refuses_and_change_nothing() {
    let mut s = Settings::default();
    assert_eq!(
        s.set_max_split_size_mb(19),
        Err(SettingsError::InvalidValue {
            key: "max_split_size_mb".into(),
            value: "19".into(),
            reason: "too small, must be >= 20".into()
        })
    );
    for x in [0.0, 1.0, -0.5, f64::NAN, f64::INFINITY] {
        assert!(
            matches!(s.set_garbage_collection_threshold(x),
                Err(SettingsError::InvalidValue { ref key, .. }) if key == "garbage_collection_threshold"),
            "{x}"
        );
    }
    for x in [-0.01, 1.01, f64::NAN] {
        assert!(
            matches!(s.set_per_process_memory_fraction(x),
                Err(SettingsError::InvalidValue { ref key, .. }) if key == "per_process_memory_fraction"),
            "{x}"
        );
    }
    for d in [0, 3, 12] {
        assert_eq!(
            s.set_roundup_power2_divisions(d),
            Err(SettingsError::InvalidValue {
                key: "roundup_power2_divisions".into(),
                value: d.to_string(),
                reason: "must be a power of two".into()
            })
        );
    }
    assert_eq!(s, Settings::default());
}

#[test]
fn negative_zero_fraction_is_stored_as_zero() {
    let mut s = Settings::default();
    s.set_per_process_memory_fraction(-0.0).expect("valid");
    assert!(
        s.per_process_memory_fraction
            .is_some_and(|x| x.is_sign_positive())
    );
}

// --- roundup_divisions_for ---------------------------------------------------------------

#[test]
fn divisions_for_a_size_use_its_power_of_two_interval() {
    let mut s = Settings::default();
    for (i, d) in s.roundup_power2_divisions.iter_mut().enumerate() {
        *d = i as u64 + 100;
    }
    for (size, index) in [
        (0, 0),
        (1, 0),
        (MB - 1, 0),
        (MB, 0),
        (2 * MB - 1, 0),
        (2 * MB, 1),
        (256 * MB, 8),
        (512 * MB - 1, 8),
        (32 << 30, 15),
        ((64 << 30) - 1, 15),
        (64 << 30, 15),
        (u64::MAX, 15),
    ] {
        assert_eq!(s.roundup_divisions_for(size), index + 100, "size {size}");
    }
}

// --- from_env --------------------------------------------------------------------------

#[test]
fn from_env_gives_the_defaults_for_an_unset_or_impossible_variable() {
    assert_eq!(
        Settings::from_env("CACHALOT_SETTINGS_TEST_SURELY_UNSET_5f1c"),
        Ok(Settings::default())
    );
    for name in ["", "A=B", "A\0B"] {
        assert_eq!(Settings::from_env(name), Ok(Settings::default()));
    }
}

#[test]
fn from_env_reads_the_variable_it_names() {
    // No test may set a variable (other tests read the environment at the same time), so
    // this reads one every test process has: PATH, whose value is no configuration string.
    // Read and parsed, it is refused; not read, it would give the defaults.
    let path = std::env::var("PATH").expect("PATH is set");
    assert!(!path.is_empty());
    assert_eq!(Settings::from_env("PATH"), Settings::parse(&path));
    assert!(Settings::from_env("PATH").is_err(), "{path}");
}

#[test]
fn from_env_parses_the_value_and_refuses_non_unicode() {
    use std::ffi::OsString;
    assert_eq!(
        from_env_value("V", Some(OsString::new())),
        Ok(Settings::default())
    );
    assert_eq!(
        from_env_value("V", Some("expandable_segments:True".into())),
        Ok(parse("expandable_segments:True"))
    );
    assert_eq!(
        from_env_value("V", Some("nope:1".into())),
        Err(SettingsError::UnknownKey { key: "nope".into() })
    );
    #[cfg(unix)]
    {
        use std::os::unix::ffi::OsStringExt;
        assert_eq!(
            from_env_value("V", Some(OsString::from_vec(vec![0xff, 0xfe]))),
            Err(SettingsError::NotUnicode { var: "V".into() })
        );
    }
}

// --- Display ---------------------------------------------------------------------------

#[test]
fn the_defaults_display_as_the_empty_string() {
    assert_eq!(Settings::default().to_string(), "");
    // PyTorch's settings differ from cachalot's in rule 21's four keys.
    let pytorch = "expandable_segments:False,expandable_page_mb:20,reclaim_headroom:off,\
                   thread_cache_blocks:0";
    assert_eq!(Settings::pytorch().to_string(), pytorch);
    assert_eq!(Settings::parse(pytorch), Ok(Settings::pytorch()));
    // The bound itself is taken.
    assert_eq!(parse("thread_cache_blocks:1024").thread_cache_blocks, 1024);
    assert_eq!(
        Settings::parse("thread_cache_blocks:1025").unwrap_err(),
        SettingsError::InvalidValue {
            key: "thread_cache_blocks".into(),
            value: "1025".into(),
            reason: "too large, must be <= 1024".into()
        }
    );
}

#[test]
fn hand_written_settings_display_canonically_and_parse_back() {
    for (input, canonical) in [
        ("max_split_size_mb:128", "max_split_size_mb:128"),
        (
            " garbage_collection_threshold : 0.60 , max_split_size_mb : 0128 ",
            "max_split_size_mb:128,garbage_collection_threshold:0.6",
        ),
        ("roundup_power2_divisions:4", "roundup_power2_divisions:4"),
        (
            "roundup_power2_divisions:[256:1,512:2,1024:4,>:8]",
            "roundup_power2_divisions:[256:1,512:2,1024:4,>:8]",
        ),
        (
            "roundup_power2_divisions:[32768:2]",
            "roundup_power2_divisions:2",
        ),
        (
            "roundup_power2_divisions:[128:8,256:16,512:1,2048:8,>:2]",
            "roundup_power2_divisions:[128:8,256:16,512:1,1024:0,2048:8,>:2]",
        ),
        (
            "roundup_power2_divisions:[>:8]",
            "roundup_power2_divisions:[1:0,>:8]",
        ),
        (
            "roundup_power2_divisions:[16384:4,>:1]",
            "roundup_power2_divisions:[16384:4,>:1]",
        ),
        (
            "roundup_power2_divisions:[1:1,2:0]",
            "roundup_power2_divisions:[1:1,>:0]",
        ),
        (
            "backend:cudaMallocAsync,expandable_segments:True,per_process_memory_fraction:1",
            "per_process_memory_fraction:1,backend:cudaMallocAsync",
        ),
        (
            "pinned_num_register_threads:1,pinned_use_cuda_host_register:False,\
             pinned_use_background_threads:False,release_lock_on_cudamalloc:False,\
             max_non_split_rounding_mb:1024",
            "max_non_split_rounding_mb:1024",
        ),
        (
            "per_process_memory_fraction:0",
            "per_process_memory_fraction:0",
        ),
        ("expandable_segments:True", ""),
        ("expandable_segments:False", "expandable_segments:False"),
        ("page_aliasing:False", ""),
        ("page_aliasing:True", "page_aliasing:True"),
        (
            "page_aliasing:False,expandable_segments:False",
            "expandable_segments:False",
        ),
        (
            "expandable_page_mb:4,page_aliasing:True,reclaim_headroom:0.25",
            "expandable_page_mb:4,reclaim_headroom:0.25,page_aliasing:True",
        ),
        (
            "reclaim_headroom:0.10,expandable_page_mb:020",
            "expandable_page_mb:20,reclaim_headroom:0.1",
        ),
        (
            "max_split_size_mb:99999999999999999",
            "max_split_size_mb:17592186044415",
        ),
    ] {
        let s = parse(input);
        assert_eq!(s.to_string(), canonical, "display of {input:?}");
        assert_eq!(parse(canonical), s, "parse of {canonical:?}");
    }
}

#[test]
fn page_aliasing_is_printed_only_beside_expandable_segments() {
    // Over PyTorch's defaults, cachalot's settings name every key of rule 21 (aliasing is not
    // one of them, stitching is, last); with aliasing on (and so stitching off), it is named
    // last.
    let own = Settings::cachalot().config_over(&Settings::pytorch());
    assert_eq!(
        own,
        "expandable_segments:True,expandable_page_mb:2,reclaim_headroom:0.025,\
         thread_cache_blocks:8,page_stitching:True"
    );
    assert_eq!(Settings::pytorch().apply(&own), Ok(Settings::cachalot()));
    let aliasing = Settings {
        page_aliasing: true,
        page_stitching: false,
        ..Settings::cachalot()
    };
    let shown = aliasing.config_over(&Settings::pytorch());
    assert!(shown.ends_with(",page_aliasing:True"), "{shown}");
    assert_eq!(Settings::pytorch().apply(&shown), Ok(aliasing));
    // Settings made by hand with aliasing but without expandable segments (as a fallback to
    // segments makes them) print what they act as: no aliasing, so the string still parses.
    let fallback = Settings {
        expandable_segments: false,
        page_aliasing: true,
        page_stitching: false,
        ..Settings::cachalot()
    };
    let shown = fallback.config_over(&Settings::pytorch());
    assert!(!shown.contains("page_aliasing"), "{shown}");
    let back = Settings::pytorch().apply(&shown).unwrap();
    assert!(!back.page_aliasing && !back.expandable_segments);
}

#[test]
fn page_stitching_is_read_as_a_boolean_over_expandable_segments() {
    // Rule 23: on in cachalot's defaults (rule 21), off in PyTorch's, spelled True or False.
    assert!(Settings::cachalot().page_stitching);
    assert!(!Settings::pytorch().page_stitching);
    assert!(parse("").page_stitching);
    assert!(parse("page_stitching:True").page_stitching);
    assert!(!parse("page_stitching:False").page_stitching);
    assert!(parse("page_stitching:False,page_stitching:True").page_stitching);
    let over_pytorch = |s: &str| Settings::pytorch().apply(s);
    let s = over_pytorch("expandable_segments:True,page_stitching:True").unwrap();
    assert!(s.page_stitching && s.expandable_segments && !s.page_aliasing);
    assert_eq!(
        over_pytorch("page_stitching:True,expandable_segments:True"),
        Ok(s)
    );
    for bad in ["true", "1", "on", "TRUE", ""] {
        assert!(
            Settings::parse(&format!("page_stitching:{bad}")).is_err(),
            "{bad} accepted"
        );
    }
}

#[test]
fn page_stitching_without_expandable_segments_is_refused() {
    let reason = "stitched views need expandable_segments:True (a view maps pages of \
                  expandable segments' ranges a second time)";
    for s in [
        "expandable_segments:False,page_stitching:True",
        "page_stitching:True,expandable_segments:False",
        "page_stitching:False,page_stitching:True,expandable_segments:False",
    ] {
        assert_invalid(s, "page_stitching", "True", reason);
    }
    assert_eq!(
        Settings::pytorch()
            .apply("page_stitching:True")
            .unwrap_err(),
        SettingsError::InvalidValue {
            key: "page_stitching".into(),
            value: "True".into(),
            reason: reason.into(),
        }
    );
    // Inherited and not named, it is turned off with expandable segments.
    let on = parse("page_stitching:True");
    let off = on.apply("expandable_segments:False").unwrap();
    assert!(!off.page_stitching && !off.expandable_segments);
    assert!(
        !off.apply("expandable_segments:True")
            .unwrap()
            .page_stitching
    );
}

#[test]
fn page_stitching_beside_page_aliasing_is_refused() {
    let reason = "page_stitching cannot be on together with page_aliasing:True (rule 23 keeps \
                  every page at its home; rule 22 moves homes)";
    for s in [
        "page_stitching:True,page_aliasing:True",
        "page_aliasing:True,page_stitching:True",
        "expandable_segments:True,page_aliasing:True,reclaim_headroom:0.1,page_stitching:True",
    ] {
        assert_invalid(s, "page_stitching", "True", reason);
    }
    // Over settings that already have one, asking for the other is refused too; turning the
    // first off in the same string is accepted.
    let aliasing = parse("page_aliasing:True");
    assert!(aliasing.apply("page_stitching:True").is_err());
    let s = aliasing
        .apply("page_aliasing:False,page_stitching:True")
        .unwrap();
    assert!(s.page_stitching && !s.page_aliasing);
    // Asking for aliasing over settings that only inherited stitching (cachalot's defaults)
    // turns stitching off; naming both is refused.
    let stitching = parse("page_stitching:True");
    let s = stitching.apply("page_aliasing:True").unwrap();
    assert!(s.page_aliasing && !s.page_stitching);
    assert_eq!(parse("page_aliasing:True"), s);
    let e = err("page_stitching:True,page_aliasing:True").to_string();
    assert!(
        e.contains("page_stitching") && e.contains("page_aliasing"),
        "{e}"
    );
}

#[test]
fn page_stitching_is_printed_only_when_on_beside_expandable_segments() {
    // Display names what differs from cachalot's defaults, where stitching is on.
    assert!(!Settings::cachalot().to_string().contains("page_stitching"));
    let stitching = Settings::cachalot();
    let shown = stitching.config_over(&Settings::pytorch());
    assert!(shown.ends_with(",page_stitching:True"), "{shown}");
    assert_eq!(Settings::pytorch().apply(&shown), Ok(stitching));
    let off = parse("page_stitching:False");
    assert_eq!(off.to_string(), "page_stitching:False");
    assert_eq!(parse(&off.to_string()), off);
    let fallback = Settings {
        expandable_segments: false,
        page_stitching: true,
        ..Settings::cachalot()
    };
    let shown = fallback.config_over(&Settings::pytorch());
    assert!(!shown.contains("page_stitching"), "{shown}");
    let back = Settings::pytorch().apply(&shown).unwrap();
    assert!(!back.page_stitching);
}

#[test]
fn displayed_lists_do_not_depend_on_the_table_they_are_applied_over() {
    let s = parse("roundup_power2_divisions:[128:8,256:16,512:1,2048:8,>:2]");
    let base = parse("roundup_power2_divisions:64");
    assert_eq!(base.apply(&s.to_string()), Ok(s.clone()));
}

// --- properties ------------------------------------------------------------------------

/// Words and punctuation of the language, glued at random.
fn token_soup() -> impl Strategy<Value = String> {
    let atoms = prop::sample::select(vec![
        "max_split_size_mb",
        "max_non_split_rounding_mb",
        "roundup_power2_divisions",
        "garbage_collection_threshold",
        "expandable_segments",
        "per_process_memory_fraction",
        "release_lock_on_cudamalloc",
        "pinned_use_cuda_host_register",
        "pinned_num_register_threads",
        "pinned_use_background_threads",
        "backend",
        "native",
        "cudaMallocAsync",
        "page_aliasing",
        "page_stitching",
        "[",
        "]",
        ":",
        ",",
        ">",
        " ",
        "0",
        "1",
        "2",
        "8",
        "20",
        "256",
        "65536",
        "0.5",
        "1e-3",
        "-1",
        "nan",
        "True",
        "False",
        "18446744073709551616",
        "é",
    ]);
    prop::collection::vec(atoms, 0..24).prop_map(|v| v.concat())
}

/// Keys and values of the alphabet in `key:value,` shape, separators mostly right, so that
/// a good share parse to something other than the defaults.
fn near_miss() -> impl Strategy<Value = String> {
    let keys = prop::sample::select(Key::ALL.map(Key::name).to_vec());
    let colon = prop::sample::select(vec![":", ":", ":", ":", ",", "", "[", " : "]);
    let values = prop::sample::select(vec![
        "20",
        "256",
        "0",
        "1",
        "8",
        "0.5",
        "1e-3",
        "True",
        "False",
        "native",
        "cudaMallocAsync",
        "[256:1,512:2,1024:4,>:8]",
        "[>:2]",
        "[1:1,2:0]",
        "[256:1,]",
        "[256:1",
        "[]",
    ]);
    let comma = prop::sample::select(vec![",", ",", ",", ",", ":", "]", "", ", "]);
    prop::collection::vec((keys, colon, values, comma), 0..6).prop_map(|v| {
        let mut s: String = v
            .iter()
            .map(|(k, c, x, m)| format!("{k}{c}{x}{m}"))
            .collect();
        if s.ends_with(',') {
            s.pop();
        }
        s
    })
}

fn pow2_or_zero(max_log2: u32) -> impl Strategy<Value = u64> {
    prop_oneof![Just(0u64), (0..=max_log2).prop_map(|k| 1u64 << k)]
}

/// Configuration strings that are mostly valid.
fn config_string() -> impl Strategy<Value = String> {
    let bool_word = || any::<bool>().prop_map(|b| if b { "True" } else { "False" });
    let entry = prop_oneof![
        3 => ((0u32..20), pow2_or_zero(10)).prop_map(|(k, d)| format!("{}:{d}", 1u64 << k)),
        1 => pow2_or_zero(10).prop_map(|d| format!(">:{d}")),
    ];
    let list = prop::collection::vec(entry, 1..6).prop_map(|v| format!("[{}]", v.join(",")));
    let pair = prop_oneof![
        (0u64..100_000).prop_map(|n| format!("max_split_size_mb:{n}")),
        (0u64..5_000).prop_map(|n| format!("max_non_split_rounding_mb:{n}")),
        (0.0f64..1.0).prop_map(|x| format!("garbage_collection_threshold:{x}")),
        pow2_or_zero(12).prop_map(|d| format!("roundup_power2_divisions:{d}")),
        list.prop_map(|l| format!("roundup_power2_divisions:{l}")),
        bool_word().prop_map(|b| format!("expandable_segments:{b}")),
        (0.0f64..=1.0).prop_map(|x| format!("per_process_memory_fraction:{x}")),
        bool_word().prop_map(|b| format!("release_lock_on_cudamalloc:{b}")),
        bool_word().prop_map(|b| format!("pinned_use_cuda_host_register:{b}")),
        pow2_or_zero(8).prop_map(|n| format!("pinned_num_register_threads:{n}")),
        bool_word().prop_map(|b| format!("pinned_use_background_threads:{b}")),
        prop::sample::select(vec!["native", "cudaMallocAsync"])
            .prop_map(|b| format!("backend:{b}")),
        (0u64..1100).prop_map(|n| format!("thread_cache_blocks:{n}")),
        bool_word().prop_map(|b| format!("page_aliasing:{b}")),
        bool_word().prop_map(|b| format!("page_stitching:{b}")),
    ];
    prop::collection::vec(pair, 0..8).prop_map(|v| v.join(","))
}

/// Settings within the ranges the parser enforces, built directly.
fn valid_settings() -> impl Strategy<Value = Settings> {
    let size =
        |default: u64| prop_oneof![Just(default), (20u64..=MAX_SIZE_MB).prop_map(|mb| mb * MB)];
    let division = || pow2_or_zero(63);
    let table = prop_oneof![
        Just([0u64; 16]),
        division().prop_map(|d| [d; 16]),
        prop::array::uniform16(division()),
        (division(), division(), division(), 0usize..16, 0usize..16).prop_map(|(a, b, c, i, j)| {
            let (i, j) = (i.min(j), i.max(j));
            let mut t = [b; 16];
            t[..i].fill(a);
            t[j..].fill(c);
            t
        }),
    ];
    (
        size(u64::MAX),
        size(20 * MB),
        prop_oneof![Just(0.0), f64::MIN_POSITIVE..1.0],
        table,
        any::<bool>(),
        prop::option::of(0.0f64..=1.0),
        prop_oneof![
            Just(AllocatorBackend::Native),
            Just(AllocatorBackend::CudaMallocAsync)
        ],
        (1u64..=512).prop_map(|n| n * 2 * MB),
        prop::option::of(0.0f64..=1.0),
        any::<bool>(),
        any::<bool>(),
        prop::option::of((2u64..=1 << 20).prop_map(|n| n * MB)),
    )
        .prop_map(
            |(msz, nsr, gc, table, exp, frac, backend, page, reclaim, alias, stitch, handle)| {
                Settings {
                    max_split_size: msz,
                    max_non_split_rounding_size: nsr,
                    garbage_collection_threshold: gc,
                    roundup_power2_divisions: table,
                    expandable_segments: exp,
                    per_process_memory_fraction: frac,
                    backend,
                    thread_cache_blocks: (msz % 4) as u32 * 7,
                    expandable_page_size: page,
                    reclaim_headroom: reclaim,
                    // The parser never gives aliasing without expandable segments (rule 22).
                    page_aliasing: alias && exp,
                    // Nor stitching without them, nor beside aliasing (rule 23).
                    page_stitching: stitch && exp && !alias,
                    // Nor handles of several pages beside aliasing (rule 19j).
                    expandable_handle_size: handle.filter(|_| !(alias && exp)),
                }
            },
        )
}

/// parse(display(parse(s))) == parse(s) whenever s parses.
fn check_round_trip(s: &str) -> Result<(), TestCaseError> {
    if let Ok(settings) = Settings::parse(s) {
        let shown = settings.to_string();
        prop_assert_eq!(
            Settings::parse(&shown),
            Ok(settings),
            "{:?} displayed as {:?}",
            s,
            shown
        );
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2048))]

    #[test]
    fn arbitrary_strings_never_panic(s in any::<String>()) {
        let _ = Settings::parse(&s);
        let _ = Settings::pytorch().apply(&s);
    }

    #[test]
    fn token_soup_never_panics_and_round_trips_when_it_parses(
        s in prop_oneof![token_soup(), near_miss()]
    ) {
        check_round_trip(&s)?;
    }

    #[test]
    fn generated_config_strings_round_trip_when_they_parse(s in config_string()) {
        check_round_trip(&s)?;
    }

    #[test]
    fn valid_settings_display_as_a_string_that_parses_back_to_them(s in valid_settings()) {
        let shown = s.to_string();
        prop_assert_eq!(Settings::parse(&shown), Ok(s), "displayed as {:?}", shown);
    }
}

#[test]
fn expandable_handle_mb_takes_mib_from_2_to_2_pow_20_or_off_and_refuses_page_aliasing() {
    assert_eq!(
        parse("expandable_handle_mb:8").expandable_handle_size,
        Some(8 * MB)
    );
    assert_eq!(
        parse("expandable_handle_mb:1048576").expandable_handle_size,
        Some(1048576 * MB)
    );
    assert_eq!(
        Settings::parse("expandable_handle_mb:8,expandable_handle_mb:off")
            .unwrap()
            .expandable_handle_size,
        None
    );
    for bad in ["0", "1", "1048577", "-2", "2.5", "on"] {
        assert!(
            Settings::parse(&format!("expandable_handle_mb:{bad}")).is_err(),
            "{bad} should be refused"
        );
    }
    // Off unless set, in both policies.
    assert_eq!(Settings::pytorch().expandable_handle_size, None);
    assert_eq!(Settings::cachalot().expandable_handle_size, None);
    // Not beside page aliasing; asking for aliasing over an inherited threshold drops it.
    assert_invalid(
        "expandable_handle_mb:8,page_aliasing:True,page_stitching:False",
        "expandable_handle_mb",
        "8",
        "expandable_handle_mb cannot be set together with page_aliasing:True (rule 22 moves \
         single pages, and a handle of several pages maps only whole)",
    );
    let inherited = Settings::parse("expandable_handle_mb:8").unwrap();
    let aliasing = inherited
        .apply("page_aliasing:True,page_stitching:False")
        .unwrap();
    assert_eq!(aliasing.expandable_handle_size, None);
    // It displays and parses back.
    let shown = inherited.to_string();
    assert!(shown.contains("expandable_handle_mb:8"), "{shown}");
    assert_eq!(Settings::parse(&shown).unwrap(), inherited);
}
