//! The differential harness: the allocator and the model side by side.
//!
//! The one rule: after every operation the two must agree on everything a user can observe —
//! success or the error and its figures, the address handed out, every statistic, the layout of
//! every segment, the device's memory — and both must pass their own invariant checks.

use cachalot::{BackendError, BlockState, CachingCore, Error, SimDevice, StreamId};
use cachalot_model::{Model, ModelError};

use crate::op::{Op, STREAMS};
use crate::scenario::{Knobs, Scenario};

/// An outcome both sides can be compared on.
#[derive(Clone, Debug, PartialEq)]
pub enum Outcome {
    /// Success, with the address for an allocation (0 otherwise).
    Ok(u64),
    /// Out of memory, with the figures of the message.
    OutOfMemory {
        /// Segment size tried.
        alloc_size: u64,
        /// Device capacity.
        capacity: u64,
        /// Device free memory.
        device_free: u64,
        /// The memory-fraction limit.
        allowed: Option<u64>,
        /// Bytes allocated.
        allocated: u64,
        /// Bytes reserved but not allocated.
        reserved_unallocated: u64,
    },
    /// Above the largest request served.
    TooLarge,
    /// Not a live allocation.
    UnknownPointer,
    /// A memory fraction outside [0, 1].
    InvalidFraction,
    /// A segment to adopt that fails rule 18a's checks.
    InvalidAdoption,
    /// A segment to adopt that the device has no room for (rule 18b).
    AdoptionOutOfMemory,
    /// Any other error (a harness bug if it ever appears on one side only).
    Other(String),
}

/// The allocator's result as an [`Outcome`], with `value` giving the number to compare.
pub fn from_alloc<T>(r: Result<T, Error>, value: impl Fn(T) -> u64) -> Outcome {
    match r {
        Ok(v) => Outcome::Ok(value(v)),
        Err(Error::OutOfMemory(o)) => Outcome::OutOfMemory {
            alloc_size: o.alloc_size,
            capacity: o.capacity,
            device_free: o.device_free,
            allowed: o.allowed,
            allocated: o.allocated,
            reserved_unallocated: o.reserved_unallocated,
        },
        Err(Error::TooLarge { .. }) => Outcome::TooLarge,
        Err(Error::UnknownPointer { .. }) => Outcome::UnknownPointer,
        Err(Error::InvalidFraction { .. }) => Outcome::InvalidFraction,
        Err(Error::InvalidAdoption { .. }) => Outcome::InvalidAdoption,
        Err(Error::Backend(BackendError::OutOfMemory)) => Outcome::AdoptionOutOfMemory,
        Err(e) => Outcome::Other(e.to_string()),
    }
}

/// The model's result as an [`Outcome`], with `value` giving the number to compare.
pub fn from_model<T>(r: Result<T, ModelError>, value: impl Fn(T) -> u64) -> Outcome {
    match r {
        Ok(v) => Outcome::Ok(value(v)),
        Err(ModelError::OutOfMemory {
            alloc_size,
            capacity,
            device_free,
            allowed,
            allocated,
            reserved_unallocated,
        }) => Outcome::OutOfMemory {
            alloc_size,
            capacity,
            device_free,
            allowed,
            allocated,
            reserved_unallocated,
        },
        Err(ModelError::TooLarge { .. }) => Outcome::TooLarge,
        Err(ModelError::UnknownAddress { .. }) => Outcome::UnknownPointer,
        Err(ModelError::InvalidFraction { .. }) => Outcome::InvalidFraction,
        Err(ModelError::InvalidAdoption { .. }) => Outcome::InvalidAdoption,
        Err(ModelError::AdoptionOutOfMemory { .. }) => Outcome::AdoptionOutOfMemory,
    }
}

/// A segment as both sides report it: address, size, stream, (small pool, expandable), and
/// blocks as `(address, size, requested, state)` with state 0 free, 1 allocated, 2 pending.
pub type Layout = Vec<(u64, u64, u64, (bool, bool), Vec<(u64, u64, u64, u8)>)>;

/// The allocator's layout in the common form.
pub fn allocator_layout(core: &CachingCore<SimDevice>) -> Layout {
    core.segments()
        .into_iter()
        .map(|s| {
            let blocks = s
                .blocks
                .iter()
                .map(|b| {
                    let st = match b.state {
                        BlockState::Free => 0,
                        BlockState::Allocated => 1,
                        BlockState::Pending => 2,
                    };
                    (b.address, b.size, if st == 0 { 0 } else { b.requested }, st)
                })
                .collect();
            (
                s.address,
                s.size,
                s.stream.0,
                (s.pool == cachalot::sizes::Pool::Small, s.expandable),
                blocks,
            )
        })
        .collect()
}

/// The model's layout in the common form.
pub fn model_layout(model: &Model) -> Layout {
    model
        .layout()
        .into_iter()
        .map(|s| {
            let blocks = s
                .blocks
                .iter()
                .map(|b| {
                    let st = match b.state {
                        cachalot_model::BlockState::Free => 0,
                        cachalot_model::BlockState::Allocated => 1,
                        cachalot_model::BlockState::Pending => 2,
                    };
                    (b.address, b.size, if st == 0 { 0 } else { b.requested }, st)
                })
                .collect();
            (s.address, s.size, s.stream, (s.small, s.expandable), blocks)
        })
        .collect()
}

/// The allocator and the model, driven together.
pub struct Differential {
    /// The allocator under test, on the simulated device.
    pub alloc: CachingCore<SimDevice>,
    /// The reference model.
    pub model: Model,
    live: Vec<u64>,
    freed: Vec<u64>,
    step: usize,
}

impl Differential {
    /// Both sides, configured by `knobs`.
    pub fn new(knobs: &Knobs) -> Result<Differential, String> {
        let alloc = CachingCore::new(SimDevice::new(knobs.capacity), knobs.settings())
            .map_err(|e| e.to_string())?;
        let model = Model::new(knobs.model_config(Vec::new()));
        Ok(Differential {
            alloc,
            model,
            live: Vec::new(),
            freed: Vec::new(),
            step: 0,
        })
    }

    /// Live allocations, in the order they were made.
    pub fn live(&self) -> &[u64] {
        &self.live
    }

    fn stream(i: u8) -> u64 {
        u64::from(i % STREAMS)
    }

    /// Applies one operation to both sides and compares everything observable.
    pub fn apply(&mut self, op: &Op) -> Result<(), String> {
        self.step += 1;
        let (a, m) = match *op {
            Op::Malloc { size, stream } => {
                let s = Self::stream(stream);
                let a = from_alloc(self.alloc.malloc(size, StreamId(s)), |v| v);
                let m = from_model(self.model.malloc(size, s), |v| v);
                if let (Outcome::Ok(addr), Outcome::Ok(_)) = (&a, &m)
                    && *addr != 0
                {
                    self.live.push(*addr);
                }
                (a, m)
            }
            Op::Free { pick } => {
                if self.live.is_empty() {
                    let addr = 0xdead_0000;
                    (
                        from_alloc(self.alloc.free(addr), |_| 0),
                        from_model(self.model.free(addr), |_| 0),
                    )
                } else {
                    let addr = self.live.remove(pick as usize % self.live.len());
                    let r = (
                        from_alloc(self.alloc.free(addr), |_| 0),
                        from_model(self.model.free(addr), |_| 0),
                    );
                    self.freed.push(addr);
                    r
                }
            }
            Op::RecordStream { pick, stream } => {
                let s = Self::stream(stream);
                let addr = if self.live.is_empty() {
                    0xdead_0000
                } else {
                    self.live[pick as usize % self.live.len()]
                };
                (
                    from_alloc(self.alloc.record_stream(addr, StreamId(s)), |_| 0),
                    from_model(self.model.record_stream(addr, s), |_| 0),
                )
            }
            Op::CompleteStream { stream } => {
                let s = Self::stream(stream);
                self.alloc.backend_mut().complete_stream(StreamId(s));
                self.model.complete_stream(s);
                (Outcome::Ok(0), Outcome::Ok(0))
            }
            Op::EmptyCache => (
                from_alloc(self.alloc.empty_cache(), |_| 0),
                Outcome::Ok({
                    self.model.empty_cache();
                    0
                }),
            ),
            Op::SetFraction { per_mille } => {
                let f = f64::from(per_mille) / 1000.0;
                (
                    from_alloc(self.alloc.set_memory_fraction(f), |_| 0),
                    from_model(self.model.set_memory_fraction(f), |_| 0),
                )
            }
            Op::FailDeviceAllocs { n } => {
                self.alloc.backend_mut().fail_next_allocs(u32::from(n));
                self.model.fail_next_device_allocs(u32::from(n));
                (Outcome::Ok(0), Outcome::Ok(0))
            }
            Op::FreeForeign { address } => {
                let addr = foreign_address(address, &self.freed, |a| self.live.contains(&a));
                (
                    from_alloc(self.alloc.free(addr), |_| 0),
                    from_model(self.model.free(addr), |_| 0),
                )
            }
            Op::Adopt { ref segment } => {
                let a = from_alloc(self.alloc.adopt_segment(segment.to_allocator()), |_| 0);
                let m = from_model(self.model.adopt_segment(segment.to_model()), |_| 0);
                if (&a, &m) == (&Outcome::Ok(0), &Outcome::Ok(0)) {
                    self.live.extend(segment.allocated());
                }
                (a, m)
            }
            Op::SetNextAddress { address } => {
                self.alloc.backend_mut().set_next_address(address);
                self.model.set_next_address(address);
                (Outcome::Ok(0), Outcome::Ok(0))
            }
        };
        if a != m {
            return Err(format!(
                "step {}: {op:?}: allocator gave {a:?}, model gave {m:?}",
                self.step
            ));
        }
        self.compare()
            .map_err(|e| format!("step {}: after {op:?}: {e}", self.step))
    }

    /// Compares statistics, layout, device memory and both invariant checks.
    pub fn compare(&self) -> Result<(), String> {
        compare_stats(self.alloc.stats(), &self.model.stats())?;
        let (la, lm) = (allocator_layout(&self.alloc), model_layout(&self.model));
        if la != lm {
            return Err(format!(
                "layouts differ:\n allocator {la:x?}\n model     {lm:x?}"
            ));
        }
        if self.alloc.backend().used() != self.model.device_used() {
            return Err(format!(
                "device memory differs: allocator's device {} vs model's {}",
                self.alloc.backend().used(),
                self.model.device_used()
            ));
        }
        self.alloc
            .check_invariants()
            .map_err(|e| format!("allocator invariant: {e}"))?;
        self.model
            .check_invariants()
            .map_err(|e| format!("model invariant: {e}"))?;
        Ok(())
    }
}

/// Compares every statistic of the two sides; the error lists the fields that differ.
pub fn compare_stats(alloc: &cachalot::Stats, model: &cachalot_model::Stats) -> Result<(), String> {
    // Fast path (serialising to JSON took most of a fuzz run's time): equal flattened
    // (field, number) lists mean equal JSON; otherwise JSON, field by field, decides.
    if flat::numbers(alloc).is_some_and(|a| Some(a) == flat::numbers(model)) {
        return Ok(());
    }
    let sa = serde_json::to_value(alloc).map_err(|e| e.to_string())?;
    let sm = serde_json::to_value(model).map_err(|e| e.to_string())?;
    if sa != sm {
        let mut diffs = Vec::new();
        diff_json("", &sa, &sm, &mut diffs);
        return Err(format!(
            "statistics differ (allocator vs model): {}",
            diffs.join("; ")
        ));
    }
    Ok(())
}

/// The address a `FreeForeign` op frees: one freed earlier (a double free) or `address`
/// itself, made odd (never a block address) when it is 0 or still live.
pub fn foreign_address(address: u64, freed: &[u64], is_live: impl Fn(u64) -> bool) -> u64 {
    let mut addr = if address.is_multiple_of(2) && !freed.is_empty() {
        freed[(address / 2) as usize % freed.len()]
    } else {
        address
    };
    if addr == 0 || is_live(addr) {
        addr |= 1;
    }
    addr
}

fn diff_json(path: &str, a: &serde_json::Value, b: &serde_json::Value, out: &mut Vec<String>) {
    match (a, b) {
        (serde_json::Value::Object(x), serde_json::Value::Object(y)) => {
            for (k, va) in x {
                let p = if path.is_empty() {
                    k.clone()
                } else {
                    format!("{path}.{k}")
                };
                match y.get(k) {
                    Some(vb) => diff_json(&p, va, vb, out),
                    None => out.push(format!("{p} missing in model")),
                }
            }
            for k in y.keys().filter(|k| !x.contains_key(*k)) {
                out.push(format!("{path}.{k} missing in allocator"));
            }
        }
        _ if a != b => out.push(format!("{path}: {a} vs {b}")),
        _ => {}
    }
}

/// Runs a whole scenario; the error names the step and what differed.
pub fn run_scenario(scenario: &Scenario) -> Result<(), String> {
    let mut d = Differential::new(&scenario.knobs)?;
    d.compare()?;
    for op in &scenario.ops {
        d.apply(op)?;
    }
    // Free everything and empty the cache: both must come back to an empty device.
    while !d.live.is_empty() {
        d.apply(&Op::Free { pick: 0 })?;
    }
    for s in 0..STREAMS {
        d.apply(&Op::CompleteStream { stream: s })?;
    }
    d.apply(&Op::EmptyCache)?;
    if d.alloc.backend().used() != 0 {
        return Err(format!(
            "{} bytes still held after freeing everything and emptying the cache",
            d.alloc.backend().used()
        ));
    }
    Ok(())
}

/// Statistics flattened through their `Serialize` impl, for comparing them without building
/// JSON: a value made of structs and integers becomes, in serialisation order, one
/// `(field, number)` per integer and a `(field, OPEN)` / `(field, CLOSE)` pair around each
/// struct, so equal lists mean the two values serialise to equal JSON (the converse also needs
/// the same field order).
/// Anything else (strings, floats, sequences, ...) is unsupported: `numbers` gives `None`.
mod flat {
    use serde::ser::{self, Impossible, Serialize, SerializeStruct, Serializer};

    const OPEN: i128 = i128::MIN;
    const CLOSE: i128 = i128::MAX;

    /// The value's fields and integers in order, or `None` if it holds anything else.
    pub fn numbers<T: Serialize + ?Sized>(value: &T) -> Option<Vec<(&'static str, i128)>> {
        let mut out = Vec::with_capacity(256);
        value
            .serialize(Flat {
                out: &mut out,
                field: "",
            })
            .ok()?;
        Some(out)
    }

    #[derive(Debug)]
    pub struct Unsupported;

    impl std::fmt::Display for Unsupported {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("not a struct of integers")
        }
    }

    impl std::error::Error for Unsupported {}

    impl ser::Error for Unsupported {
        fn custom<T: std::fmt::Display>(_: T) -> Self {
            Unsupported
        }
    }

    struct Flat<'a> {
        out: &'a mut Vec<(&'static str, i128)>,
        field: &'static str,
    }

    impl Flat<'_> {
        fn push(self, v: i128) -> Result<(), Unsupported> {
            self.out.push((self.field, v));
            Ok(())
        }
    }

    macro_rules! unsupported {
        ($($f:ident($($t:ty),*) -> $r:ty;)*) => {
            $(fn $f(self, $(_: $t),*) -> Result<$r, Unsupported> { Err(Unsupported) })*
        };
    }

    impl<'a> Serializer for Flat<'a> {
        type Ok = ();
        type Error = Unsupported;
        type SerializeSeq = Impossible<(), Unsupported>;
        type SerializeTuple = Impossible<(), Unsupported>;
        type SerializeTupleStruct = Impossible<(), Unsupported>;
        type SerializeTupleVariant = Impossible<(), Unsupported>;
        type SerializeMap = Impossible<(), Unsupported>;
        type SerializeStruct = Self;
        type SerializeStructVariant = Impossible<(), Unsupported>;

        fn serialize_i8(self, v: i8) -> Result<(), Unsupported> {
            self.push(v.into())
        }
        fn serialize_i16(self, v: i16) -> Result<(), Unsupported> {
            self.push(v.into())
        }
        fn serialize_i32(self, v: i32) -> Result<(), Unsupported> {
            self.push(v.into())
        }
        fn serialize_i64(self, v: i64) -> Result<(), Unsupported> {
            self.push(v.into())
        }
        fn serialize_u8(self, v: u8) -> Result<(), Unsupported> {
            self.push(v.into())
        }
        fn serialize_u16(self, v: u16) -> Result<(), Unsupported> {
            self.push(v.into())
        }
        fn serialize_u32(self, v: u32) -> Result<(), Unsupported> {
            self.push(v.into())
        }
        fn serialize_u64(self, v: u64) -> Result<(), Unsupported> {
            self.push(v.into())
        }
        fn serialize_struct(self, _: &'static str, _: usize) -> Result<Self, Unsupported> {
            self.out.push((self.field, OPEN));
            Ok(self)
        }
        fn serialize_some<T: Serialize + ?Sized>(self, _: &T) -> Result<(), Unsupported> {
            Err(Unsupported)
        }
        fn serialize_newtype_struct<T: Serialize + ?Sized>(
            self,
            _: &'static str,
            _: &T,
        ) -> Result<(), Unsupported> {
            Err(Unsupported)
        }
        fn serialize_newtype_variant<T: Serialize + ?Sized>(
            self,
            _: &'static str,
            _: u32,
            _: &'static str,
            _: &T,
        ) -> Result<(), Unsupported> {
            Err(Unsupported)
        }
        unsupported! {
            serialize_bool(bool) -> ();
            serialize_f32(f32) -> ();
            serialize_f64(f64) -> ();
            serialize_char(char) -> ();
            serialize_str(&str) -> ();
            serialize_bytes(&[u8]) -> ();
            serialize_none() -> ();
            serialize_unit() -> ();
            serialize_unit_struct(&'static str) -> ();
            serialize_unit_variant(&'static str, u32, &'static str) -> ();
            serialize_seq(Option<usize>) -> Self::SerializeSeq;
            serialize_tuple(usize) -> Self::SerializeTuple;
            serialize_tuple_struct(&'static str, usize) -> Self::SerializeTupleStruct;
            serialize_tuple_variant(&'static str, u32, &'static str, usize) -> Self::SerializeTupleVariant;
            serialize_map(Option<usize>) -> Self::SerializeMap;
            serialize_struct_variant(&'static str, u32, &'static str, usize) -> Self::SerializeStructVariant;
        }
    }

    impl SerializeStruct for Flat<'_> {
        type Ok = ();
        type Error = Unsupported;

        fn serialize_field<T: Serialize + ?Sized>(
            &mut self,
            key: &'static str,
            value: &T,
        ) -> Result<(), Unsupported> {
            value.serialize(Flat {
                out: &mut *self.out,
                field: key,
            })
        }

        fn end(self) -> Result<(), Unsupported> {
            self.push(CLOSE)
        }
    }

    #[cfg(test)]
    mod tests {
        #[derive(serde::Serialize)]
        struct Inner {
            a: i64,
            b: u64,
        }
        #[derive(serde::Serialize)]
        struct Outer {
            x: Inner,
            y: u64,
        }
        #[derive(serde::Serialize)]
        struct Renamed {
            x: Inner,
            z: u64,
        }

        #[test]
        fn equal_lists_exactly_for_equal_json() {
            let v = |a, y| Outer {
                x: Inner { a, b: 2 },
                y,
            };
            assert_eq!(super::numbers(&v(1, 3)), super::numbers(&v(1, 3)));
            assert_ne!(super::numbers(&v(1, 3)), super::numbers(&v(-1, 3)));
            assert_ne!(super::numbers(&v(1, 3)), super::numbers(&v(1, 4)));
            let r = Renamed {
                x: Inner { a: 1, b: 2 },
                z: 3,
            };
            assert_ne!(super::numbers(&v(1, 3)), super::numbers(&r));
            assert_eq!(super::numbers("text"), None);
        }
    }
}
