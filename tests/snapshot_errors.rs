//! Bad input gives a `SnapshotError` naming the input and what is wrong; never a panic, never
//! unbounded memory.

use std::io::Write;
use std::path::{Path, PathBuf};

use cachalot_tools::snapshot::{
    ReadLimits, SnapshotError, parse_snapshot, parse_snapshot_with_limits, read_figures,
    read_snapshot, read_snapshot_with_limits,
};
use rand::rngs::Xoshiro256PlusPlus;
use rand::{RngExt, SeedableRng};
use serde_pickle::{HashableValue as H, Value as V};

mod common;
use common::fixtures_root as fixtures;

fn fixture_bytes(name: &str) -> Vec<u8> {
    std::fs::read(fixtures().join("traces").join(name)).unwrap()
}

fn dict(pairs: Vec<(&str, V)>) -> V {
    V::Dict(
        pairs
            .into_iter()
            .map(|(k, v)| (H::String(k.into()), v))
            .collect(),
    )
}

fn s(x: &str) -> V {
    V::String(x.into())
}

fn entry(action: &str, addr: i64, size: i64) -> V {
    dict(vec![
        ("action", s(action)),
        ("addr", V::I64(addr)),
        ("size", V::I64(size)),
        ("stream", V::I64(0)),
        ("time_us", V::I64(1)),
    ])
}

fn block(size: i64, state: &str) -> V {
    dict(vec![
        ("size", V::I64(size)),
        ("requested_size", V::I64(size)),
        ("state", s(state)),
    ])
}

fn segment(address: i64, total: i64, blocks: Vec<V>) -> V {
    dict(vec![
        ("device", V::I64(0)),
        ("address", V::I64(address)),
        ("total_size", V::I64(total)),
        ("stream", V::I64(0)),
        ("segment_type", s("large")),
        ("blocks", V::List(blocks)),
    ])
}

fn snapshot(segments: Vec<V>, traces: Vec<Vec<V>>) -> V {
    dict(vec![
        ("segments", V::List(segments)),
        (
            "device_traces",
            V::List(traces.into_iter().map(V::List).collect()),
        ),
    ])
}

fn pickle(v: &V) -> Vec<u8> {
    serde_pickle::value_to_vec(v, serde_pickle::SerOptions::new()).unwrap()
}

fn parse_err(bytes: &[u8]) -> SnapshotError {
    match parse_snapshot(bytes) {
        Ok(s) => panic!("parsed into {s:?}"),
        Err(e) => e,
    }
}

#[test]
fn the_hand_built_base_case_parses() {
    let v = snapshot(
        vec![segment(
            1 << 30,
            20 << 20,
            vec![
                block(4 << 20, "active_allocated"),
                block(16 << 20, "inactive"),
            ],
        )],
        vec![vec![
            entry("segment_alloc", 1 << 30, 20 << 20),
            entry("alloc", 1 << 30, 4 << 20),
        ]],
    );
    let snap = parse_snapshot(&pickle(&v)).unwrap();
    assert_eq!(snap.traces[0].entries.len(), 2);
    assert_eq!(snap.segments[0].blocks[1].address, (1 << 30) + (4 << 20));
}

#[test]
fn empty_input() {
    assert!(matches!(parse_err(b""), SnapshotError::NotPickle { .. }));
    let dir = tempdir();
    let path = dir.join("empty.pickle");
    std::fs::File::create(&path).unwrap();
    let err = read_snapshot(&path).unwrap_err();
    assert!(matches!(err, SnapshotError::NotPickle { .. }), "{err}");
    assert!(err.to_string().contains("empty.pickle"), "{err}");
}

#[test]
fn missing_file_names_the_file() {
    let err = read_snapshot(Path::new("no/such/snapshot.pickle")).unwrap_err();
    assert!(matches!(err, SnapshotError::Io { .. }), "{err}");
    assert!(err.to_string().contains("no/such/snapshot.pickle"), "{err}");
    let err = read_figures(Path::new("no/such/figures.json")).unwrap_err();
    assert!(err.to_string().contains("no/such/figures.json"), "{err}");
}

#[test]
fn every_prefix_of_a_real_snapshot_is_truncated() {
    let bytes = fixture_bytes("seed_experiment.pickle");
    for n in 1..bytes.len() {
        match parse_snapshot(&bytes[..n]) {
            Err(SnapshotError::Truncated { .. }) => {}
            other => panic!("prefix of {n} bytes: {other:?}"),
        }
    }
    let bytes = fixture_bytes("two_stream.pickle");
    for n in (1..bytes.len())
        .step_by(37)
        .chain(bytes.len() - 40..bytes.len())
    {
        assert!(
            matches!(
                parse_snapshot(&bytes[..n]),
                Err(SnapshotError::Truncated { .. })
            ),
            "prefix of {n} bytes"
        );
    }
}

#[test]
fn truncated_gzip() {
    let bytes = fixture_bytes("two_stream.pickle");
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    gz.write_all(&bytes).unwrap();
    let gz = gz.finish().unwrap();
    assert!(parse_snapshot(&gz).is_ok());
    for n in [2, 10, gz.len() / 2, gz.len() - 1] {
        let err = parse_err(&gz[..n]);
        assert!(matches!(err, SnapshotError::Truncated { .. }), "{n}: {err}");
    }
    let mut bad = gz.clone();
    bad[3] = 0xff; // reserved flag bits
    assert!(parse_snapshot(&bad).is_err());
}

#[test]
fn pickles_of_other_things_are_not_snapshots() {
    for (what, v) in [
        ("an int", V::I64(5)),
        ("a list", V::List(vec![V::I64(1), s("x")])),
        ("a string", s("segments")),
        ("None", V::None),
        (
            "a dict without device_traces",
            dict(vec![("segments", V::List(vec![]))]),
        ),
        (
            "a dict without segments",
            dict(vec![("device_traces", V::List(vec![]))]),
        ),
        (
            "device_traces of the wrong type",
            dict(vec![
                ("segments", V::List(vec![])),
                ("device_traces", s("no")),
            ]),
        ),
        (
            "an entry without action",
            snapshot(vec![], vec![vec![dict(vec![("addr", V::I64(1))])]]),
        ),
        (
            "an alloc without size",
            snapshot(
                vec![],
                vec![vec![dict(vec![
                    ("action", s("alloc")),
                    ("addr", V::I64(1)),
                ])]],
            ),
        ),
        ("a string size", {
            let mut e = entry("alloc", 1, 1);
            if let V::Dict(m) = &mut e {
                m.insert(H::String("size".into()), s("big"));
            }
            snapshot(vec![], vec![vec![e]])
        }),
        ("a medium segment", {
            let mut seg = segment(0, 512, vec![block(512, "inactive")]);
            if let V::Dict(m) = &mut seg {
                m.insert(H::String("segment_type".into()), s("medium"));
            }
            snapshot(vec![seg], vec![])
        }),
        (
            "an unknown block state",
            snapshot(vec![segment(0, 512, vec![block(512, "zombie")])], vec![]),
        ),
    ] {
        let err = parse_err(&pickle(&v));
        assert!(
            matches!(err, SnapshotError::NotSnapshot { .. }),
            "{what}: {err}"
        );
        assert!(err.to_string().contains("<bytes>"), "{what}: {err}");
    }
    let err = parse_err(&pickle(&dict(vec![("segments", V::List(vec![]))])));
    assert!(err.to_string().contains("device_traces"), "{err}");
    let err = parse_err(&pickle(&snapshot(
        vec![],
        vec![vec![entry("alloc", 1, 1), {
            let mut e = entry("alloc", 1, 1);
            if let V::Dict(m) = &mut e {
                m.insert(H::String("size".into()), s("big"));
            }
            e
        }]],
    )));
    assert!(
        err.to_string().contains("device_traces[0][1].size"),
        "{err}"
    );
}

#[test]
fn absurd_values() {
    let cases: Vec<(&str, V)> = vec![
        (
            "device_traces[0][0].size",
            snapshot(vec![], vec![vec![entry("alloc", 4096, -5)]]),
        ),
        (
            "device_traces[0][0].size",
            snapshot(vec![], vec![vec![entry("alloc", 4096, 1 << 61)]]),
        ),
        (
            "device_traces[0][0].addr",
            snapshot(vec![], vec![vec![entry("free_requested", -1, 8)]]),
        ),
        (
            "segments[0].total_size",
            snapshot(vec![segment(0, -512, vec![])], vec![]),
        ),
        (
            "segments[0].blocks",
            snapshot(vec![segment(0, 4096, vec![block(512, "inactive")])], vec![]),
        ),
        (
            "segments[0].blocks[0].size",
            snapshot(vec![segment(0, 512, vec![block(-512, "inactive")])], vec![]),
        ),
        ("segments[0].device", {
            let mut seg = segment(0, 512, vec![block(512, "inactive")]);
            if let V::Dict(m) = &mut seg {
                m.insert(H::String("device".into()), V::I64(5_000_000));
            }
            snapshot(vec![seg], vec![])
        }),
        ("device_traces", snapshot(vec![], vec![vec![]; 2_000_000])),
    ];
    for (at, v) in cases {
        match parse_err(&pickle(&v)) {
            SnapshotError::Absurd { at: got, .. } => assert_eq!(got, at),
            other => panic!("{at}: {other}"),
        }
    }
}

#[test]
fn an_integer_wider_than_64_bits_is_absurd() {
    // {'segments': [], 'device_traces': [[{'action': 'alloc', 'addr': 2**64, 'size': 1}]]}
    let mut p = b"\x80\x04}(\x8c\x08segments]\x8c\x0ddevice_traces]](}(".to_vec();
    p.extend_from_slice(b"\x8c\x06action\x8c\x05alloc\x8c\x04addr\x8a\x09");
    p.extend_from_slice(&[0, 0, 0, 0, 0, 0, 0, 0, 1]);
    p.extend_from_slice(b"\x8c\x04sizeK\x01ueau.");
    let err = parse_err(&p);
    assert!(matches!(err, SnapshotError::Absurd { .. }), "{err}");
}

/// A deterministic generator (`rand`'s xoshiro256++, seeded).
fn seeded(seed: u64) -> Xoshiro256PlusPlus {
    Xoshiro256PlusPlus::seed_from_u64(seed)
}

#[test]
fn random_bytes_never_panic() {
    let mut rng = seeded(0x9e37_79b9_7f4a_7c15);
    let mut errors = 0;
    for round in 0..4000 {
        let len = rng.random_range(0..300);
        let mut bytes: Vec<u8> = (0..len).map(|_| rng.random::<u8>()).collect();
        if round % 2 == 0 && bytes.len() >= 2 {
            // look like a protocol 4 pickle, to get past the first opcode
            bytes[0] = 0x80;
            bytes[1] = 4;
        }
        if round % 5 == 0 {
            // draw opcodes from the ones snapshots use
            const OPS: &[u8] = b"}](Kqh\x94\x8c\x95eua.0)\x85\x86tlds";
            for b in bytes.iter_mut().skip(2) {
                if rng.random_range(0..3) > 0 {
                    *b = OPS[rng.random_range(0..OPS.len())];
                }
            }
        }
        if parse_snapshot(&bytes).is_err() {
            errors += 1;
        }
    }
    assert!(
        errors > 3900,
        "random bytes parsed as snapshots: {}",
        4000 - errors
    );
}

#[test]
fn mutated_snapshots_never_panic() {
    let original = fixture_bytes("fraction_oom_retry.pickle");
    let mut rng = seeded(42);
    for _ in 0..1500 {
        let mut bytes = original.clone();
        for _ in 0..1 + rng.random_range(0..4) {
            let i = rng.random_range(0..bytes.len());
            bytes[i] = rng.random::<u8>();
        }
        if rng.random_range(0..4) == 0 {
            let cut = rng.random_range(0..bytes.len());
            bytes.truncate(cut);
        }
        let _ = parse_snapshot(&bytes);
    }
}

fn too_large(bytes: &[u8]) {
    match parse_snapshot(bytes) {
        Err(SnapshotError::TooLarge { .. }) => {}
        other => panic!("{other:?}"),
    }
}

#[test]
fn deep_nesting_is_refused_before_decoding() {
    // 200 000 nested lists would overflow the stack of a recursive decoder
    let mut p = b"\x80\x04".to_vec();
    p.extend(std::iter::repeat_n(b']', 200_000));
    p.extend(std::iter::repeat_n(b'a', 199_999));
    p.push(b'.');
    too_large(&p);
    // the same nesting through MARK ... LIST
    let mut p = b"\x80\x04".to_vec();
    p.extend(std::iter::repeat_n(b'(', 100_000));
    p.extend(std::iter::repeat_n(b'l', 100_000));
    p.push(b'.');
    too_large(&p);
}

/// A snapshot whose ignored `external_annotations` key holds `value` (pickle opcodes that
/// leave one value on the stack).
fn snapshot_with_annotations(value: &[u8]) -> Vec<u8> {
    let mut p =
        b"\x80\x04}(\x8c\x08segments]\x8c\x0ddevice_traces]\x8c\x14external_annotations".to_vec();
    p.extend_from_slice(value);
    p.extend_from_slice(b"u.");
    p
}

#[test]
fn memo_reference_bombs_are_cheap_now() {
    // x0 = [0]; x(i+1) = [xi]*8 (memo references): 2^(3*20) values once expanded (20 levels,
    // within the depth limit), from under 1 KiB. References share what they refer to, so this
    // stores a few hundred values.
    let mut bomb = b"](K\x00e\x94".to_vec();
    for i in 0..20u8 {
        bomb.push(b'0'); // POP the previous list (it stays in the memo)
        bomb.extend_from_slice(b"](");
        for _ in 0..8 {
            bomb.extend_from_slice(&[b'h', i]);
        }
        bomb.extend_from_slice(b"e\x94");
    }
    let start = std::time::Instant::now();
    let snap = parse_snapshot(&snapshot_with_annotations(&bomb)).unwrap();
    assert!(snap.traces.is_empty());
    // the same bomb where a snapshot is expected: a clean refusal
    let mut p = b"\x80\x04".to_vec();
    p.extend_from_slice(&bomb);
    p.push(b'.');
    assert!(matches!(parse_err(&p), SnapshotError::NotSnapshot { .. }));
    // one frame dict referenced a million times as one entry's stack: a million-frame stack of
    // one distinct frame
    let mut p = b"\x80\x04}(\x8c\x08segments]\x8c\x0ddevice_traces]](}(".to_vec();
    p.extend_from_slice(b"\x8c\x06action\x8c\x05alloc\x8c\x04addrK\x01\x8c\x04sizeK\x01");
    p.extend_from_slice(b"\x8c\x06frames](}(\x8c\x04name\x8c\x01f\x8c\x08filename\x8c\x01g");
    p.extend_from_slice(b"\x8c\x04lineK\x07u\x94");
    p.extend(std::iter::repeat_n(*b"h\x00", 1_000_000).flatten());
    p.extend_from_slice(b"eueau.");
    let snap = parse_snapshot(&p).unwrap();
    assert_eq!(snap.frames.num_frames(), 1);
    let stack = snap.traces[0].entries[0].stack;
    assert_eq!(snap.frames.stack(stack).len(), 1_000_001);
    assert!(start.elapsed().as_secs() < 20, "took {:?}", start.elapsed());
    // over a lower limit on stored values, the same input is refused
    let few = ReadLimits {
        max_values: 100_000,
        ..ReadLimits::default()
    };
    assert!(matches!(
        parse_snapshot_with_limits(&p, &few),
        Err(SnapshotError::TooLarge { .. })
    ));
}

#[test]
fn dup_shares_and_leftovers_are_refused() {
    // DUP pushes the same list again (shared, not copied); a pickle that leaves values on the
    // stack at STOP is not one Python's pickler writes
    let mut p = b"\x80\x04](".to_vec();
    for _ in 0..100_000 {
        p.extend_from_slice(b"K\x01");
    }
    p.push(b'e');
    p.extend(std::iter::repeat_n(b'2', 10_000));
    p.push(b'.');
    assert!(matches!(parse_err(&p), SnapshotError::NotPickle { .. }));
    let few = ReadLimits {
        max_values: 105_000,
        ..ReadLimits::default()
    };
    assert!(matches!(
        parse_snapshot_with_limits(&p, &few),
        Err(SnapshotError::TooLarge { .. })
    ));
}

#[test]
fn memo_indexes_cycles_and_long_integers() {
    // a memo index of 2^32 - 1 is stored sparsely, not as a 4-billion-slot table
    let v = snapshot_with_annotations(b"K\x05r\xff\xff\xff\xff0j\xff\xff\xff\xff");
    assert!(parse_snapshot(&v).is_ok());
    // reading a slot never written
    let v = snapshot_with_annotations(b"j\xfe\xff\xff\xff");
    let err = parse_err(&v);
    assert!(matches!(err, SnapshotError::NotPickle { .. }), "{err}");
    assert!(err.to_string().contains("4294967294"), "{err}");
    // a list appended into itself, a dict put into itself
    for cycle in [&b"]\x94h\x00a"[..], b"}\x94\x8c\x01kh\x00s"] {
        let err = parse_err(&snapshot_with_annotations(cycle));
        assert!(matches!(err, SnapshotError::NotPickle { .. }), "{err}");
    }
    // changing a list after it was put into another
    let err = parse_err(&snapshot_with_annotations(b"]\x94]h\x00a0h\x00K\x01a"));
    assert!(matches!(err, SnapshotError::NotPickle { .. }), "{err}");
    // LONG4 whose 20 bytes run past the end; LONG4 of 2^31 - 1 bytes; negative length
    let err = parse_err(b"\x80\x04\x8b\x14\x00\x00\x00\x01\x02");
    assert!(matches!(err, SnapshotError::Truncated { .. }), "{err}");
    let err = parse_err(b"\x80\x04\x8b\xff\xff\xff\x7f\x01\x02.");
    assert!(matches!(err, SnapshotError::TooLarge { .. }), "{err}");
    let err = parse_err(b"\x80\x04\x8b\xff\xff\xff\xff\x01\x02.");
    assert!(matches!(err, SnapshotError::NotPickle { .. }), "{err}");
    // LONG1 and LONG4 integers that fit 64 bits read as such
    let v = snapshot_with_annotations(
        b"\x8a\x09\xff\xff\xff\xff\xff\xff\xff\xff\xff0\x8b\x02\x00\x00\x00\x01\x00",
    );
    assert!(parse_snapshot(&v).is_ok());
}

#[test]
fn huge_length_prefixes_do_not_allocate() {
    // BINUNICODE8 / BINBYTES8 claiming 2^62 bytes, BINUNICODE claiming 4 GiB
    for op in [&b"\x8d"[..], b"\x8e", b"\x96"] {
        let mut p = b"\x80\x04".to_vec();
        p.extend_from_slice(op);
        p.extend_from_slice(&(1u64 << 62).to_le_bytes());
        p.extend_from_slice(b"abc.");
        assert!(matches!(parse_err(&p), SnapshotError::Truncated { .. }));
    }
    let p = b"\x80\x04X\xff\xff\xff\xffabc.";
    assert!(matches!(parse_err(p), SnapshotError::Truncated { .. }));
    // a 1000-byte integer
    let mut p = b"\x80\x04\x8b\xe8\x03\x00\x00".to_vec();
    p.extend(std::iter::repeat_n(7u8, 1000));
    p.push(b'.');
    too_large(&p);
}

#[test]
fn python_objects_and_trailing_bytes_are_not_snapshots() {
    // pickle.dumps(set(), protocol=4): builtins.set via STACK_GLOBAL + REDUCE
    let set = b"\x80\x04\x95\x0f\x00\x00\x00\x00\x00\x00\x00\x8c\x08builtins\x94\x8c\x03set\x94\x93\x94)R\x94.";
    assert!(matches!(parse_err(set), SnapshotError::NotPickle { .. }));
    let mut p = pickle(&snapshot(vec![], vec![vec![]]));
    assert!(parse_snapshot(&p).is_ok());
    p.extend_from_slice(b"junk");
    assert!(matches!(parse_err(&p), SnapshotError::NotPickle { .. }));
    assert!(matches!(
        parse_err(b"\x80\x07N."),
        SnapshotError::NotPickle { .. }
    ));
    assert!(matches!(
        parse_err(b"hello world"),
        SnapshotError::NotPickle { .. }
    ));
}

#[test]
fn limits_are_enforced() {
    let bytes = fixture_bytes("two_stream.pickle");
    let few_values = ReadLimits {
        max_values: 1000,
        ..ReadLimits::default()
    };
    assert!(matches!(
        parse_snapshot_with_limits(&bytes, &few_values),
        Err(SnapshotError::TooLarge { .. })
    ));
    let few_bytes = ReadLimits {
        max_input_bytes: 1000,
        ..ReadLimits::default()
    };
    let path = fixtures().join("traces/two_stream.pickle");
    let err = read_snapshot_with_limits(&path, &few_bytes).unwrap_err();
    assert!(matches!(err, SnapshotError::TooLarge { .. }), "{err}");
    assert!(err.to_string().contains("two_stream.pickle"), "{err}");
    let shallow = ReadLimits {
        max_depth: 4,
        ..ReadLimits::default()
    };
    assert!(matches!(
        parse_snapshot_with_limits(&bytes, &shallow),
        Err(SnapshotError::TooLarge { .. })
    ));
    let one_device = ReadLimits {
        max_devices: 1,
        ..ReadLimits::default()
    };
    assert!(parse_snapshot_with_limits(&bytes, &one_device).is_ok());
    let v = snapshot(vec![], vec![vec![], vec![]]);
    assert!(matches!(
        parse_snapshot_with_limits(&pickle(&v), &one_device),
        Err(SnapshotError::Absurd { .. })
    ));
}

#[test]
fn a_bad_figures_file_names_itself() {
    let dir = tempdir();
    let path = dir.join("w.json");
    std::fs::write(&path, b"{\"workload\": 5}").unwrap();
    let err = read_figures(&path).unwrap_err();
    assert!(matches!(err, SnapshotError::Figures { .. }), "{err}");
    assert!(err.to_string().contains("w.json"), "{err}");
}

fn tempdir() -> PathBuf {
    use std::sync::atomic::{AtomicUsize, Ordering};
    static N: AtomicUsize = AtomicUsize::new(0);
    let dir = std::env::temp_dir().join(format!(
        "cachalot-snapshot-errors-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn a_nan_garbage_collection_threshold_is_absurd_input() {
    // The fuzzer's finding: a snapshot whose allocator_settings hold a NaN threshold.
    let path = fixtures().join("../../fuzz/regressions/snapshot_reader/nan_gc_threshold");
    let bytes = std::fs::read(&path).unwrap();
    let err = cachalot_tools::snapshot::parse_snapshot(&bytes)
        .unwrap_err()
        .to_string();
    assert!(err.contains("garbage_collection_threshold"), "{err}");
}
