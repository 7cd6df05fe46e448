//! Reads a snapshot file and prints what it holds and how long reading took (a measurement
//! aid: run it under `/usr/bin/time -v` for the peak memory), and optionally writes it back
//! with cachalot's writer (`--write OUT`), frames included.

use std::time::Instant;

fn main() {
    let Some(path) = std::env::args().nth(1) else {
        eprintln!("usage: read_snapshot FILE [--stats] [--write OUT]");
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
    let args: Vec<String> = std::env::args().collect();
    if let Some(out) = args
        .iter()
        .position(|a| a == "--write")
        .and_then(|i| args.get(i + 1))
    {
        // Written back by cachalot's writer, frames included (for checks with PyTorch's tools).
        let file = std::fs::File::create(out).expect("create the output file");
        cachalot_tools::snapshot::write_snapshot(&snap, std::io::BufWriter::new(file))
            .expect("write the snapshot");
        println!("written to {out}");
    }
    if args.iter().any(|a| a == "--stats") {
        drop(snap);
        let bytes = std::fs::read(&path).expect("read the file");
        match cachalot_tools::snapshot::decode_stats(&bytes) {
            Ok((values, nodes)) => println!("values stored {values}, arena nodes {nodes}"),
            Err(e) => println!("{e}"),
        }
    }
}
