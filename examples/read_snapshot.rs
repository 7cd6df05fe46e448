//! Reads a snapshot file and prints what it holds and how long reading took (a measurement
//! aid: run it under `/usr/bin/time -v` for the peak memory).

use std::time::Instant;

fn main() {
    let Some(path) = std::env::args().nth(1) else {
        eprintln!("usage: read_snapshot FILE [--stats]");
        std::process::exit(2);
    };
    let t = Instant::now();
    let snap = match cachalot_tools::snapshot::read_snapshot(std::path::Path::new(&path)) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(1);
        }
    };
    let elapsed = t.elapsed();
    let entries: usize = snap.traces.iter().map(|t| t.entries.len()).sum();
    println!(
        "read in {:.3} s: {} segments, {} trace entries, {} distinct frames, {} distinct stacks",
        elapsed.as_secs_f64(),
        snap.segments.len(),
        entries,
        snap.frames.num_frames(),
        snap.frames.num_stacks()
    );
    if std::env::args().any(|a| a == "--stats") {
        drop(snap);
        let bytes = std::fs::read(&path).expect("read the file");
        match cachalot_tools::snapshot::decode_stats(&bytes) {
            Ok((values, nodes)) => println!("values stored {values}, arena nodes {nodes}"),
            Err(e) => println!("{e}"),
        }
    }
}
