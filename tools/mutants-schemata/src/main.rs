//! Mutant schemata for cargo-mutants' mutants (issue: prove the tests bite).
//!
//! cargo-mutants builds every mutant on its own: on the 2-core VM that is 25–50 s of compiling
//! per mutant, and the tests of most mutants fail in a few seconds. This tool writes *every*
//! mutant of `cargo mutants --list --json` into the crate's source at once, each behind a switch
//! read at run time (`crate::__mutant(ID)`: true only for the mutant whose number is in the
//! environment variable given with `--env`), so one build of the crate and its tests serves all
//! of them, and each mutant costs only its tests. `scripts/mutants_schemata.py` drives it.
//!
//! Each mutant is cargo-mutants' own textual change: a switch chooses between the mutated text
//! and the original, around the smallest expression the change can affect. For an operator that
//! is the whole chain of binary operations it stands in, since the changed text is parsed again
//! as cargo-mutants' is (`a - b + c` with `+` → `*` is `a - (b * c)`, and `a && b && c` with
//! the first `&&` → `||` is `a || (b && c)`); for the others, the unary operation, the match
//! guard, the struct expression, or the function (an early return at its start). Only one mutant
//! is on in a run, so a mutant's branch holds plain text, and only the original branch holds the
//! other switches.
//!
//! ```text
//! mutants-schemata --list LIST.json --root DIR --env VAR --map MAP.json [--disable IDS]
//! ```
//!
//! `DIR` is a copy of the repository: its files are rewritten in place. The mutant numbers are
//! the positions in LIST (from 0). `IDS` holds numbers (one per line) to leave out: the driver
//! finds them in the compiler's errors (a mutant whose switch does not type-check, as in a
//! `const fn` or an `impl Trait` return) and runs them with cargo-mutants instead. `MAP` gets,
//! per file, the byte ranges each mutant's code occupies in the rewritten file (so an error can
//! be traced back to its mutants) and the numbers that could not be placed at all.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fs;
use std::path::Path;
use std::process::ExitCode;

use proc_macro2::LineColumn;
use serde::{Deserialize, Serialize};
use syn::spanned::Spanned;
use syn::visit::Visit;

#[derive(Deserialize)]
struct Pos {
    line: usize,
    column: usize,
}

#[derive(Deserialize)]
struct SpanJson {
    start: Pos,
    end: Pos,
}

#[derive(Deserialize)]
struct Function {
    return_type: String,
}

#[derive(Deserialize)]
struct Mutant {
    file: String,
    function: Option<Function>,
    genre: String,
    replacement: String,
    span: SpanJson,
}

#[derive(Serialize, Default)]
struct Map {
    /// File → `(start, end, mutant numbers, a mutant's own text)` byte ranges in the rewritten
    /// file.
    ranges: BTreeMap<String, Ranges>,
    /// Mutants not written into the source (no matching syntax, or a form that cannot be
    /// switched at run time): the driver runs them with cargo-mutants.
    unplaced: Vec<u32>,
}

/// Byte offsets from proc-macro2's line (from 1) and column (in characters, from 0).
struct Lines<'a> {
    text: &'a str,
    starts: Vec<usize>,
}

impl<'a> Lines<'a> {
    fn new(text: &'a str) -> Self {
        let mut starts = vec![0];
        starts.extend(text.match_indices('\n').map(|(i, _)| i + 1));
        Lines { text, starts }
    }

    fn byte(&self, lc: LineColumn) -> usize {
        let start = self.starts[lc.line - 1];
        let line = &self.text[start..];
        start
            + line
                .char_indices()
                .nth(lc.column)
                .map_or(line.len(), |(i, _)| i)
    }
}

/// A byte range `[start, end)` of a source file.
type Range = (usize, usize);

/// Byte ranges of the rewritten file, each with the mutants whose code it holds, and whether
/// it is one mutant's own text (its changed code: an error there makes the mutant unviable, as
/// cargo-mutants' build of the same text would find) rather than a switch around it.
type Ranges = Vec<(usize, usize, Vec<u32>, bool)>;

#[derive(Clone, Copy)]
struct BinSite {
    /// The chain of binary operations the operator stands in: its textual replacement can
    /// regroup the operands anywhere in it, and nowhere else (parentheses, calls and blocks end
    /// it; unary operators and casts bind tighter than any binary one).
    chain: Range,
    op: Range,
    /// A `let` in the chain (a let chain): it cannot stand inside an `if` of its own.
    has_let: bool,
}

#[derive(Clone, Copy)]
struct ArmSite {
    pat_end: usize,
    /// The match has a `_` arm without a guard: deleting another arm leaves it exhaustive.
    catch_all: bool,
    guard: Option<(usize, usize)>,
}

/// The syntax cargo-mutants' mutants sit on, found by the position of their first character.
#[derive(Default)]
struct Sites {
    binary: HashMap<(usize, usize), BinSite>,
    /// The whole expression, the operator, the operand.
    unary: HashMap<(usize, usize), (Range, Range, Range)>,
    guard: HashMap<(usize, usize), (usize, usize)>,
    arm: HashMap<(usize, usize), ArmSite>,
    field: HashMap<(usize, usize), (usize, usize)>,
}

struct Finder<'a> {
    lines: &'a Lines<'a>,
    sites: Sites,
    /// While visiting the operands of a binary operation: the chain's range and whether it
    /// holds a `let`.
    chain: Option<(Range, bool)>,
}

impl Finder<'_> {
    fn range(&self, s: proc_macro2::Span) -> (usize, usize) {
        (self.lines.byte(s.start()), self.lines.byte(s.end()))
    }
}

fn key(lc: LineColumn) -> (usize, usize) {
    (lc.line, lc.column)
}

/// Whether a chain of binary operations holds a `let` (a let chain).
fn has_let(e: &syn::ExprBinary) -> bool {
    fn walk(e: &syn::Expr) -> bool {
        match e {
            syn::Expr::Let(_) => true,
            syn::Expr::Binary(b) => walk(&b.left) || walk(&b.right),
            _ => false,
        }
    }
    walk(&e.left) || walk(&e.right)
}

impl<'ast> Visit<'ast> for Finder<'_> {
    fn visit_expr_binary(&mut self, e: &'ast syn::ExprBinary) {
        let chain = self
            .chain
            .unwrap_or_else(|| (self.range(e.span()), has_let(e)));
        // A let chain's `&&`s cannot stand inside an `if` of their own (and `||` is not allowed
        // among them): they stay with cargo-mutants. Each of its conditions is a chain of its
        // own, which a switch can hold.
        let spine = chain.1 && matches!(e.op, syn::BinOp::And(_));
        self.sites.binary.insert(
            key(e.op.span().start()),
            BinSite {
                chain: chain.0,
                op: self.range(e.op.span()),
                has_let: spine || chain.1,
            },
        );
        for operand in [&*e.left, &*e.right] {
            let saved = self.chain;
            self.chain = (!spine && matches!(operand, syn::Expr::Binary(_))).then_some(chain);
            self.visit_expr(operand);
            self.chain = saved;
        }
    }

    fn visit_expr(&mut self, e: &'ast syn::Expr) {
        // Only a binary operation's direct binary operands continue its chain.
        if !matches!(e, syn::Expr::Binary(_)) {
            let saved = self.chain.take();
            syn::visit::visit_expr(self, e);
            self.chain = saved;
        } else {
            syn::visit::visit_expr(self, e);
        }
    }

    fn visit_expr_unary(&mut self, e: &'ast syn::ExprUnary) {
        let op = self.range(e.op.span());
        self.sites.unary.insert(
            key(e.op.span().start()),
            (self.range(e.span()), op, self.range(e.expr.span())),
        );
        syn::visit::visit_expr_unary(self, e);
    }

    fn visit_expr_match(&mut self, m: &'ast syn::ExprMatch) {
        let catch_all = m
            .arms
            .iter()
            .any(|a| a.guard.is_none() && matches!(a.pat, syn::Pat::Wild(_)));
        for a in &m.arms {
            let guard = a.guard.as_ref().map(|(_, g)| self.range(g.span()));
            if let Some((_, g)) = &a.guard {
                self.sites
                    .guard
                    .insert(key(g.span().start()), self.range(g.span()));
            }
            let site = ArmSite {
                pat_end: self.range(a.pat.span()).1,
                catch_all,
                guard,
            };
            self.sites.arm.insert(key(a.pat.span().start()), site);
            if let Some(attr) = a.attrs.first() {
                self.sites.arm.insert(key(attr.span().start()), site);
            }
        }
        syn::visit::visit_expr_match(self, m);
    }

    fn visit_expr_struct(&mut self, e: &'ast syn::ExprStruct) {
        let region = self.range(e.span());
        for f in &e.fields {
            self.sites.field.insert(key(f.span().start()), region);
        }
        syn::visit::visit_expr_struct(self, e);
    }
}

/// One mutant of a region: its text when switched on.
enum Variant {
    /// The region's source with this byte range replaced by this text.
    Replace(usize, usize, String),
    /// This text in place of the whole region.
    Whole(String),
}

#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Debug)]
enum Kind {
    /// A text inserted at `start` (a function's early return; a deleted arm's guard).
    Point,
    /// A match guard: its mutants replace it with `true` or `false` (a deleted arm: `false`).
    Guard,
    /// A struct expression: its mutants delete a field.
    Struct,
    /// A chain of binary operations: its mutants replace an operator.
    Binary,
    /// A unary operation: its mutants delete the operator.
    Unary,
}

struct Node {
    start: usize,
    end: usize,
    kind: Kind,
    /// A point's text.
    text: String,
    variants: Vec<(u32, Variant)>,
    kids: Vec<usize>,
}

struct Render<'a> {
    src: &'a str,
    nodes: Vec<Node>,
    out: String,
    ranges: Ranges,
}

impl Render<'_> {
    /// The source between `lo` and `hi`, with the nodes among `kids` that lie inside rendered.
    fn emit(&mut self, lo: usize, hi: usize, kids: &[usize]) {
        let mut cursor = lo;
        for &k in kids {
            let (s, e) = (self.nodes[k].start, self.nodes[k].end);
            if s < lo || e > hi || s < cursor {
                continue;
            }
            self.out.push_str(&self.src[cursor..s]);
            self.node(k);
            cursor = e;
        }
        self.out.push_str(&self.src[cursor..hi]);
    }

    /// A region: `(if crate::__mutant(A) { A's text } else if … else { the original })`. Only
    /// the original holds the switches of the regions inside: one mutant is on at a time.
    fn node(&mut self, k: usize) {
        let begin = self.out.len();
        let (start, end) = (self.nodes[k].start, self.nodes[k].end);
        let mut ids = Vec::new();
        if self.nodes[k].kind == Kind::Point {
            // `if crate::__mutant(ID) { return VALUE; } ` or ` if !crate::__mutant(ID)`.
            let t = std::mem::take(&mut self.nodes[k].text);
            let id = self.nodes[k].variants[0].0;
            if let Some(value) = t
                .strip_prefix(&format!("if crate::__mutant({id}) {{ return "))
                .and_then(|r| r.strip_suffix("; } "))
            {
                let b = begin + t.len() - value.len() - 4;
                self.ranges.push((b, b + value.len(), vec![id], true));
            }
            self.out.push_str(&t);
            ids.push(id);
        } else {
            self.out.push('(');
            for (id, v) in &self.nodes[k].variants {
                self.out.push_str(&format!("if crate::__mutant({id}) {{ "));
                let b = self.out.len();
                match v {
                    Variant::Whole(t) => self.out.push_str(t),
                    Variant::Replace(x, y, t) => {
                        self.out.push_str(&self.src[start..*x]);
                        self.out.push_str(t);
                        self.out.push_str(&self.src[*y..end]);
                    }
                }
                self.ranges.push((b, self.out.len(), vec![*id], true));
                self.out.push_str(" } else ");
                ids.push(*id);
            }
            self.out.push_str("{ ");
            let kids = std::mem::take(&mut self.nodes[k].kids);
            self.emit(start, end, &kids);
            self.out.push_str(" })");
        }
        self.ranges.push((begin, self.out.len(), ids, false));
    }
}

fn rewrite(
    path: &str,
    src: &str,
    mutants: &[(u32, &Mutant)],
    unplaced: &mut Vec<u32>,
) -> Result<(String, Ranges), String> {
    let file = syn::parse_file(src).map_err(|e| format!("{path}: {e}"))?;
    let lines = Lines::new(src);
    let mut finder = Finder {
        lines: &lines,
        sites: Sites::default(),
        chain: None,
    };
    finder.visit_file(&file);
    let sites = finder.sites;

    // Regions, one per (range, kind), each with its mutants; points, one per mutant.
    let mut nodes: Vec<Node> = Vec::new();
    let mut group: HashMap<(usize, usize, Kind), usize> = HashMap::new();
    let mut add = |nodes: &mut Vec<Node>, (start, end): Range, kind: Kind, id: u32, v: Variant| {
        let i = *group.entry((start, end, kind)).or_insert_with(|| {
            nodes.push(Node {
                start,
                end,
                kind,
                text: String::new(),
                variants: Vec::new(),
                kids: Vec::new(),
            });
            nodes.len() - 1
        });
        nodes[i].variants.push((id, v));
    };
    let point = |nodes: &mut Vec<Node>, at: usize, text: String, id: u32| {
        nodes.push(Node {
            start: at,
            end: at,
            kind: Kind::Point,
            text,
            variants: vec![(id, Variant::Whole(String::new()))],
            kids: Vec::new(),
        })
    };
    for &(id, m) in mutants {
        let k = (m.span.start.line, m.span.start.column.saturating_sub(1));
        let at = |p: &Pos| {
            lines.byte(LineColumn {
                line: p.line,
                column: p.column.saturating_sub(1),
            })
        };
        // An early return of another type cannot stand beside an `impl Trait` body: the
        // compiler's error would point at the original body, not at the switch.
        let returns_impl = m
            .function
            .as_ref()
            .is_some_and(|f| f.return_type.contains("impl "));
        match m.genre.as_str() {
            "FnValue" if returns_impl => unplaced.push(id),
            "FnValue" => point(
                &mut nodes,
                at(&m.span.start),
                format!("if crate::__mutant({id}) {{ return {}; }} ", m.replacement),
                id,
            ),
            "BinaryOperator" => match sites.binary.get(&k) {
                Some(s) if !s.has_let => add(
                    &mut nodes,
                    s.chain,
                    Kind::Binary,
                    id,
                    Variant::Replace(s.op.0, s.op.1, m.replacement.clone()),
                ),
                _ => unplaced.push(id),
            },
            "UnaryOperator" => match sites.unary.get(&k) {
                Some(&(region, op, _)) => add(
                    &mut nodes,
                    region,
                    Kind::Unary,
                    id,
                    Variant::Replace(op.0, op.1, String::new()),
                ),
                None => unplaced.push(id),
            },
            "MatchArmGuard" => match sites.guard.get(&k) {
                Some(&g) => add(
                    &mut nodes,
                    g,
                    Kind::Guard,
                    id,
                    Variant::Whole(m.replacement.clone()),
                ),
                None => unplaced.push(id),
            },
            "MatchArm" => match sites.arm.get(&k) {
                // A deleted arm is an arm that never matches: its guard is false.
                Some(ArmSite { guard: Some(g), .. }) => add(
                    &mut nodes,
                    *g,
                    Kind::Guard,
                    id,
                    Variant::Whole("false".into()),
                ),
                // Without a `_` arm the match would no longer be exhaustive: cargo-mutants
                // builds it, and finds it unviable.
                Some(ArmSite {
                    catch_all: false, ..
                }) => unplaced.push(id),
                Some(ArmSite { pat_end, .. }) => point(
                    &mut nodes,
                    *pat_end,
                    format!(" if !crate::__mutant({id})"),
                    id,
                ),
                None => unplaced.push(id),
            },
            "StructField" => match sites.field.get(&k) {
                Some(&region) => add(
                    &mut nodes,
                    region,
                    Kind::Struct,
                    id,
                    Variant::Replace(at(&m.span.start), at(&m.span.end), String::new()),
                ),
                None => unplaced.push(id),
            },
            _ => unplaced.push(id),
        }
    }

    // The tree: regions nest (they are the syntax tree's); a point lies inside a region only
    // strictly (a function's early return at the start of a region goes before it).
    let prio = |k: Kind| match k {
        Kind::Point => 0,
        Kind::Guard => 1,
        Kind::Struct => 2,
        Kind::Binary => 3,
        Kind::Unary => 4,
    };
    let mut order: Vec<usize> = (0..nodes.len()).collect();
    order.sort_by_key(|&i| {
        let n = &nodes[i];
        (
            n.start,
            n.kind != Kind::Point,
            std::cmp::Reverse(n.end),
            prio(n.kind),
            i,
        )
    });
    let contains = |a: &Node, b: &Node| {
        if b.kind == Kind::Point {
            a.kind != Kind::Point && a.start < b.start && b.start < a.end
        } else {
            a.kind != Kind::Point && a.start <= b.start && b.end <= a.end
        }
    };
    let mut roots = Vec::new();
    let mut stack: Vec<usize> = Vec::new();
    for &i in &order {
        while let Some(&top) = stack.last() {
            if contains(&nodes[top], &nodes[i]) {
                break;
            }
            stack.pop();
        }
        match stack.last() {
            Some(&top) => nodes[top].kids.push(i),
            None => roots.push(i),
        }
        stack.push(i);
    }
    let mut r = Render {
        src,
        nodes,
        out: String::with_capacity(src.len() * 2),
        ranges: Vec::new(),
    };
    r.emit(0, src.len(), &roots);
    Ok((r.out, r.ranges))
}

fn switch_fn(var: &str) -> String {
    format!(
        "\n// Mutant schemata (tools/mutants-schemata): the mutant whose number is in ${var}.\n\
         #[doc(hidden)]\n\
         #[inline]\n\
         #[allow(dead_code)]\n\
         pub(crate) fn __mutant(id: u32) -> bool {{\n    \
         static ACTIVE: ::std::sync::OnceLock<u32> = ::std::sync::OnceLock::new();\n    \
         *ACTIVE.get_or_init(|| {{\n        \
         ::std::env::var(\"{var}\").ok().and_then(|v| v.parse().ok()).unwrap_or(u32::MAX)\n    \
         }}) == id\n\
         }}\n"
    )
}

fn run() -> Result<(), String> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let opt = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    let need = |name: &str| opt(name).ok_or(format!("missing {name} (see the tool's docs)"));
    let list = need("--list")?;
    let root = need("--root")?;
    let var = need("--env")?;
    let map_path = need("--map")?;
    let disabled: BTreeSet<u32> = match opt("--disable") {
        Some(p) => fs::read_to_string(&p)
            .map_err(|e| format!("{p}: {e}"))?
            .split_whitespace()
            .map(|w| w.parse().map_err(|_| format!("{p}: not a number: {w}")))
            .collect::<Result<_, _>>()?,
        None => BTreeSet::new(),
    };
    let text = fs::read_to_string(&list).map_err(|e| format!("{list}: {e}"))?;
    let mutants: Vec<Mutant> = serde_json::from_str(&text).map_err(|e| format!("{list}: {e}"))?;
    let mut by_file: BTreeMap<&str, Vec<(u32, &Mutant)>> = BTreeMap::new();
    for (i, m) in mutants.iter().enumerate() {
        let id = u32::try_from(i).map_err(|_| "too many mutants".to_string())?;
        if !disabled.contains(&id) {
            by_file.entry(m.file.as_str()).or_default().push((id, m));
        }
    }
    let mut map = Map::default();
    let mut roots = BTreeSet::new();
    for (file, ms) in &by_file {
        let path = Path::new(&root).join(file);
        let src = fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        let (out, ranges) = rewrite(file, &src, ms, &mut map.unplaced)?;
        fs::write(&path, out).map_err(|e| format!("{}: {e}", path.display()))?;
        map.ranges.insert((*file).to_string(), ranges);
        let crate_dir = file.split("/src/").next().unwrap_or("");
        roots.insert(format!("{crate_dir}/src/lib.rs"));
    }
    for lib in roots {
        let path = Path::new(&root).join(&lib);
        let mut src = fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        src.push_str(&switch_fn(&var));
        fs::write(&path, src).map_err(|e| format!("{}: {e}", path.display()))?;
    }
    map.unplaced.sort_unstable();
    let json = serde_json::to_string(&map).map_err(|e| e.to_string())?;
    fs::write(&map_path, json).map_err(|e| format!("{map_path}: {e}"))?;
    eprintln!(
        "mutants-schemata: {} mutants in {} files, {} left out, {} not placed",
        mutants.len() - disabled.len(),
        by_file.len(),
        disabled.len(),
        map.unplaced.len()
    );
    Ok(())
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("mutants-schemata: {e}");
            ExitCode::FAILURE
        }
    }
}
