//! The first seed's experiment: PyTorch's allocated/reserved figures for a sequence of 1 GiB
//! tensors, as PyTorch itself reported them on an H200, reproduced by the allocator and by the
//! model.

use cachalot::{CachingCore, Settings, SimDevice, StreamId};
use cachalot_model::{Model, ModelConfig};

const GIB: u64 = 1 << 30;
const CAPACITY: u64 = 140 * GIB;

/// Allocated / reserved in GiB after each step, from ANCHORS.md.
const EXPECTED: [(u64, u64); 8] = [
    (1, 1),
    (2, 2),
    (1, 2),
    (2, 2),
    (2, 3),
    (3, 3),
    (2, 3),
    (3, 3),
];

/// The steps: `a`, `b`, free `b`, `c`, `c2` then free `c`, `d`, free `d`, `e`.
fn steps(
    mut malloc: impl FnMut() -> u64,
    mut free: impl FnMut(u64),
    mut figures: impl FnMut() -> (u64, u64),
) -> Vec<(u64, u64)> {
    let mut out = Vec::new();
    let _a = malloc();
    out.push(figures());
    let b = malloc();
    out.push(figures());
    free(b);
    out.push(figures());
    let c = malloc();
    out.push(figures());
    let _c2 = malloc();
    free(c);
    out.push(figures());
    let d = malloc();
    out.push(figures());
    free(d);
    out.push(figures());
    let _e = malloc();
    out.push(figures());
    out
}

#[test]
fn the_allocator_reproduces_pytorchs_figures() {
    let core = std::cell::RefCell::new(
        CachingCore::new(SimDevice::new(CAPACITY), Settings::pytorch()).unwrap(),
    );
    let got = steps(
        || core.borrow_mut().malloc(GIB, StreamId(0)).unwrap(),
        |p| core.borrow_mut().free(p).unwrap(),
        || {
            let c = core.borrow();
            let s = c.stats();
            (
                s.allocated_bytes.all.current as u64 / GIB,
                s.reserved_bytes.all.current as u64 / GIB,
            )
        },
    );
    assert_eq!(got, EXPECTED);
}

#[test]
fn the_model_reproduces_pytorchs_figures() {
    let model = std::cell::RefCell::new(Model::new(ModelConfig::pytorch_defaults(CAPACITY)));
    let got = steps(
        || model.borrow_mut().malloc(GIB, 0).unwrap(),
        |p| model.borrow_mut().free(p).unwrap(),
        || {
            let s = model.borrow().stats();
            (
                s.allocated_bytes.all.current as u64 / GIB,
                s.reserved_bytes.all.current as u64 / GIB,
            )
        },
    );
    assert_eq!(got, EXPECTED);
}
