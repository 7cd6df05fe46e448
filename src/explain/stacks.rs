//! Where each of a program's tensors was allocated, and its stack told the way a user reads it:
//! the user's own Python frames first, the library frames (PyTorch, transformers, Python
//! itself) folded into one line.
//!
//! The one rule: a stack's [`StackSummary::key`] is what groups tensors — the user's Python
//! frames, the innermost library Python frame and the innermost ATen operator (or, on the
//! autograd engine's threads, where no Python frame is recorded, the backward node) — so two
//! allocations made by the same line of the user's code through the same library call fall in
//! one group, and nothing else does.

use serde::Serialize;

use cachalot::snapshot::{Action, BlockStatus, Frame, FrameTable, Snapshot, StackId};

use crate::replay::program::{ReplayOp, ReplayProgram};

/// Where a handle of a replay program was allocated.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Origin {
    /// The trace entry (`alloc`, or `oom` for an allocation PyTorch failed) that made it;
    /// `None` for a tensor live when recording began.
    pub entry: Option<usize>,
    /// Its allocation stack ([`StackId::EMPTY`] when none is known).
    pub stack: StackId,
}

/// The origin of every handle of `program` (the replay program of `device`'s trace of
/// `snapshot`), by handle.
///
/// Handles `0..program.initial.len()` are the tensors live when recording began: their stack
/// is the dumped block's when the trace never frees them (the block is still there at the dump,
/// with the stack PyTorch recorded for its allocation), else unknown — PyTorch's `free` entries
/// carry the stack of the free, not of the allocation. Every later handle is the trace's
/// `n`-th `alloc` or `oom` entry, in order (how [`crate::replay::replay_ops_from`] numbers them).
pub fn origins(snapshot: &Snapshot, device: usize, program: &ReplayProgram) -> Vec<Origin> {
    let n = program.num_handles();
    let mut out = Vec::with_capacity(n);
    let mut freed = vec![false; program.initial.len()];
    for op in &program.ops {
        if let ReplayOp::FreeRequested { id } = *op
            && id < freed.len()
        {
            freed[id] = true;
        }
    }
    for h in &program.initial {
        let stack = if freed[h.id] {
            StackId::EMPTY
        } else {
            snapshot
                .segments
                .iter()
                .filter(|s| s.device == device)
                .flat_map(|s| &s.blocks)
                .find(|b| b.address == h.address && b.state != BlockStatus::Inactive)
                .map_or(StackId::EMPTY, |b| b.stack)
        };
        out.push(Origin { entry: None, stack });
    }
    if let Some(trace) = snapshot.traces.iter().find(|t| t.device == device) {
        for (i, e) in trace.entries.iter().enumerate() {
            if matches!(e.action, Action::Alloc | Action::Oom) {
                out.push(Origin {
                    entry: Some(i),
                    stack: e.stack,
                });
            }
        }
    }
    out.resize(
        n,
        Origin {
            entry: None,
            stack: StackId::EMPTY,
        },
    );
    out
}

/// A Python frame as reports print it.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize)]
pub struct PyFrame {
    /// The file, as recorded.
    pub file: String,
    /// The line.
    pub line: u64,
    /// The function.
    pub function: String,
}

impl PyFrame {
    fn of(f: &Frame) -> PyFrame {
        PyFrame {
            file: f.filename.clone(),
            line: f.line,
            function: f.name.clone(),
        }
    }

    /// `file.py:LINE function`, the file shortened: a library file from its package on
    /// (`torch/nn/modules/conv.py`), a user's file to its name.
    pub fn short(&self) -> String {
        format!("{}:{} {}", short_path(&self.file), self.line, self.function)
    }
}

/// A path shortened for a one-line label.
fn short_path(path: &str) -> &str {
    for marker in ["/site-packages/", "/dist-packages/"] {
        if let Some(i) = path.rfind(marker) {
            return &path[i + marker.len()..];
        }
    }
    if let Some(i) = path.find("/lib/python3")
        && let Some(j) = path[i + 1..].find('/').map(|j| i + 1 + j)
        && let Some(k) = path[j + 1..].find('/').map(|k| j + 1 + k)
    {
        return &path[k + 1..];
    }
    path.rsplit('/').next().unwrap_or(path)
}

/// The frames of stack `id`, innermost first, one line each: `file:line function` for Python
/// frames, the function alone for C++ frames.
pub fn frame_lines(table: &FrameTable, id: StackId) -> Vec<String> {
    table
        .stack(id)
        .map(|f| {
            if is_python(f) {
                format!("{}:{} {}", f.filename, f.line, f.name)
            } else {
                f.name.clone()
            }
        })
        .collect()
}

/// Whether a frame is Python code.
fn is_python(f: &Frame) -> bool {
    f.filename.ends_with(".py")
}

/// Whether a Python file is a library's (an installed package, Python's own library, frozen
/// or generated code) rather than the user's.
pub fn is_library_file(path: &str) -> bool {
    path.contains("/site-packages/")
        || path.contains("/dist-packages/")
        || path.contains("/lib/python3")
        || path.starts_with('<')
}

/// What a stack says, told the way a user reads it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct StackSummary {
    /// What groups tensors: equal keys, one group.
    pub key: String,
    /// One line: the innermost user frames, then the folded library call.
    pub label: String,
    /// The user's own Python frames, innermost first.
    pub user_frames: Vec<PyFrame>,
    /// The innermost library Python frame, when there is one.
    pub library_frame: Option<PyFrame>,
    /// Library Python frames folded away.
    pub library_frames: usize,
    /// The innermost ATen operator (`aten::addmm`), when a C++ frame names one.
    pub op: Option<String>,
    /// The autograd node whose backward made the tensor (`ConvolutionBackward0`), when the
    /// stack runs through one.
    pub autograd_node: Option<String>,
    /// Frames in the whole stack (Python and C++).
    pub frames: usize,
}

/// The group of tensors live when recording began whose allocation stack is not known.
pub const BEFORE_RECORDING: &str = "allocated before recording began (stack not recorded)";
/// The group of tensors whose trace recorded no stack.
pub const NO_STACK: &str =
    "no stack recorded (record with _record_memory_history() at its defaults)";

/// The group of allocated blocks that are no live tensor of the program: never seen in a
/// faithful replay (the tests check that it stays empty), kept so that every byte is counted.
pub const NOT_A_TENSOR: &str =
    "allocated blocks that are no live tensor of the program (a replay inconsistency)";

/// The summary of a group with no stack, labelled `label`.
pub fn unattributed(label: &str) -> StackSummary {
    StackSummary {
        key: label.to_string(),
        label: label.to_string(),
        user_frames: Vec::new(),
        library_frame: None,
        library_frames: 0,
        op: None,
        autograd_node: None,
        frames: 0,
    }
}

/// The summary of stack `id` of `table`; `before_recording` tells an unknown stack of a tensor
/// live when recording began from a trace recorded without stacks.
pub fn summarize(table: &FrameTable, id: StackId, before_recording: bool) -> StackSummary {
    let frames: Vec<&Frame> = table.stack(id).collect();
    if frames.is_empty() {
        return unattributed(if before_recording {
            BEFORE_RECORDING
        } else {
            NO_STACK
        });
    }
    let python: Vec<&Frame> = frames.iter().copied().filter(|f| is_python(f)).collect();
    let user_frames: Vec<PyFrame> = python
        .iter()
        .filter(|f| !is_library_file(&f.filename))
        .map(|f| PyFrame::of(f))
        .collect();
    let library: Vec<&Frame> = python
        .iter()
        .copied()
        .filter(|f| is_library_file(&f.filename))
        .collect();
    let library_frame = library.first().map(|f| PyFrame::of(f));
    // The innermost operator that is not a plain factory (`empty_like` inside `cudnn_batch_norm`
    // says less than the operator that called it); a factory when nothing else is named.
    let ops: Vec<String> = frames.iter().filter_map(|f| aten_op(&f.name)).collect();
    let op = ops.iter().find(|o| !is_factory(o)).or(ops.first()).cloned();
    let autograd_node = frames.iter().find_map(|f| autograd_node(&f.name));
    let mut key = String::new();
    for f in &user_frames {
        key.push_str(&format!("{}:{}:{}|", f.file, f.line, f.function));
    }
    key.push('#');
    if let Some(f) = &library_frame {
        key.push_str(&format!("{}:{}:{}", f.file, f.line, f.function));
    }
    key.push('#');
    if user_frames.is_empty() && library_frame.is_none() {
        key.push_str(autograd_node.as_deref().unwrap_or(""));
    }
    key.push('#');
    key.push_str(op.as_deref().unwrap_or(""));
    let label = label(
        &user_frames,
        library_frame.as_ref(),
        library.len(),
        op.as_deref(),
        autograd_node.as_deref(),
        frames.len(),
    );
    StackSummary {
        key,
        label,
        user_frames,
        library_frame,
        library_frames: library.len(),
        op,
        autograd_node,
        frames: frames.len(),
    }
}

fn label(
    user: &[PyFrame],
    library: Option<&PyFrame>,
    folded: usize,
    op: Option<&str>,
    node: Option<&str>,
    frames: usize,
) -> String {
    let mut parts: Vec<String> = Vec::new();
    if !user.is_empty() {
        let shown: Vec<String> = user.iter().take(3).map(PyFrame::short).collect();
        let mut s = shown.join(" ← ");
        if user.len() > 3 {
            s.push_str(&format!(" ← … ({} more)", user.len() - 3));
        }
        parts.push(s);
    }
    let mut lib = Vec::new();
    if let Some(f) = library {
        lib.push(if folded > 1 {
            format!("{} (+{} library frames)", f.short(), folded - 1)
        } else {
            f.short()
        });
    }
    if user.is_empty() && library.is_none() {
        match node {
            Some(n) => lib.push(format!("autograd backward: {n}")),
            None => lib.push(format!("C++ only ({frames} frames)")),
        }
    }
    if let Some(op) = op {
        lib.push(op.to_string());
    }
    if !lib.is_empty() {
        parts.push(format!("[{}]", lib.join(" · ")));
    }
    parts.join(" ")
}

/// `aten::NAME` for a frame `at::_ops::NAME::call(...)`.
fn aten_op(name: &str) -> Option<String> {
    let rest = name.strip_prefix("at::_ops::")?;
    let end = rest.find("::call(")?;
    let op = &rest[..end];
    (!op.is_empty() && !op.contains(':')).then(|| format!("aten::{op}"))
}

/// Whether an operator only makes a tensor (`aten::empty_strided`, `aten::zeros_like` …).
fn is_factory(op: &str) -> bool {
    let name = op.trim_start_matches("aten::");
    ["empty", "zeros", "ones", "full", "new_", "_empty"]
        .iter()
        .any(|p| name.starts_with(p))
}

/// `NAME` for a frame `torch::autograd::generated::NAME::apply(...)`.
fn autograd_node(name: &str) -> Option<String> {
    let rest = name.strip_prefix("torch::autograd::generated::")?;
    let end = rest.find("::apply(")?;
    let node = &rest[..end];
    (!node.is_empty() && !node.contains(':')).then(|| node.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(name: &str, file: &str, line: u64) -> Frame {
        Frame {
            name: name.into(),
            filename: file.into(),
            line,
        }
    }

    #[test]
    fn user_frames_come_first_and_library_frames_fold() {
        let mut t = FrameTable::default();
        let id = t.intern_stack([
            frame("c10::cuda::CUDACachingAllocator::Native::DeviceCachingAllocator::malloc(unsigned long)", "CUDACachingAllocator.cpp", 0),
            frame("at::_ops::empty_strided::call(x)", "??", 0),
            frame("at::_ops::addmm::call(at::Tensor const&)", "??", 0),
            frame("forward", "/venv/lib/python3.12/site-packages/transformers/pytorch_utils.py", 119),
            frame("_call_impl", "/venv/lib/python3.12/site-packages/torch/nn/modules/module.py", 1790),
            frame("train_step", "/home/me/train.py", 42),
            frame("main", "/home/me/train.py", 80),
        ]);
        let s = summarize(&t, id, false);
        assert_eq!(s.user_frames.len(), 2);
        assert_eq!(s.user_frames[0].line, 42);
        assert_eq!(s.library_frames, 2);
        assert_eq!(s.op.as_deref(), Some("aten::addmm"));
        assert_eq!(
            s.label,
            "train.py:42 train_step ← train.py:80 main [transformers/pytorch_utils.py:119 forward (+1 library frames) · aten::addmm]"
        );
    }

    #[test]
    fn the_same_user_line_through_another_library_call_is_another_group() {
        let mut t = FrameTable::default();
        let a = t.intern_stack([
            frame("at::_ops::addmm::call(x)", "??", 0),
            frame("f", "/x/site-packages/torch/nn/functional.py", 10),
            frame("step", "/u/train.py", 42),
        ]);
        let b = t.intern_stack([
            frame("at::_ops::addmm::call(x)", "??", 0),
            frame("f", "/x/site-packages/torch/nn/functional.py", 11),
            frame("step", "/u/train.py", 42),
        ]);
        let c = t.intern_stack([
            frame("at::_ops::addmm::call(y)", "??", 0),
            frame("f", "/x/site-packages/torch/nn/functional.py", 10),
            frame("step", "/u/train.py", 42),
        ]);
        assert_ne!(summarize(&t, a, false).key, summarize(&t, b, false).key);
        assert_eq!(summarize(&t, a, false).key, summarize(&t, c, false).key);
    }

    #[test]
    fn autograd_thread_stacks_are_told_by_their_backward_node() {
        let mut t = FrameTable::default();
        let id = t.intern_stack([
            frame("at::_ops::convolution_backward::call(x)", "??", 0),
            frame("torch::autograd::generated::ConvolutionBackward0::apply(std::vector<at::Tensor>&&)", "??", 0),
            frame("__clone", "??", 0),
        ]);
        let s = summarize(&t, id, false);
        assert_eq!(s.autograd_node.as_deref(), Some("ConvolutionBackward0"));
        assert_eq!(
            s.label,
            "[autograd backward: ConvolutionBackward0 · aten::convolution_backward]"
        );
    }

    #[test]
    fn no_stack_says_why() {
        let t = FrameTable::default();
        assert_eq!(summarize(&t, StackId::EMPTY, true).label, BEFORE_RECORDING);
        assert_eq!(summarize(&t, StackId::EMPTY, false).label, NO_STACK);
        assert_ne!(BEFORE_RECORDING, NO_STACK);
    }

    #[test]
    fn library_files_are_told_from_the_users() {
        assert!(is_library_file(
            "/opt/v/lib/python3.12/site-packages/torch/nn/modules/module.py"
        ));
        assert!(is_library_file("/usr/lib/python3.12/runpy.py"));
        assert!(is_library_file("<frozen runpy>"));
        assert!(!is_library_file("/work/main/scripts/record_unet.py"));
        assert_eq!(
            short_path("/usr/lib/python3.12/json/decoder.py"),
            "json/decoder.py"
        );
        assert_eq!(short_path("/a/b/train.py"), "train.py");
    }
}
