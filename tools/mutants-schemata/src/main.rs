//! Mutant schemata for cargo-mutants' mutants (issue: prove the tests bite).
//!
//! cargo-mutants builds every mutant on its own: on the 2-core VM that is 25–50 s of compiling
//! per mutant, and the tests of most mutants fail in a few seconds. This tool writes *every*
//! mutant of `cargo mutants --list --json` into the crate's source at once, each behind a switch
//! read at run time (`crate::__mutant(ID)`: true only for the mutant whose number is in the
//! environment variable given with `--env`), so one build of the crate and its tests serves all
//! of them, and each mutant costs only its tests. `scripts/mutants_schemata.py` drives it.
//!
//! Each mutant behaves as cargo-mutants' textual change does, with one difference, by design:
//! an operator is replaced in the expression tree (`(a - b) + c` with `+` → `*` is
//! `(a - b) * c`), where cargo-mutants' text would be parsed again (`a - b * c`).
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
    /// File → `(start, end, mutant numbers)` byte ranges in the rewritten file.
    ranges: BTreeMap<String, Vec<(usize, usize, Vec<u32>)>>,
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

/// Byte ranges of the rewritten file, each with the mutants whose code it holds.
type Ranges = Vec<(usize, usize, Vec<u32>)>;

#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Debug)]
enum BinClass {
    /// `==`, `<`, …: operands compared by reference, as the operator does.
    Compare,
    /// `&&`, `||`: the right operand is evaluated only when needed.
    Lazy,
    /// `+=`, …: a place is assigned.
    Assign,
    /// `+`, `&`, `<<`, …: operands taken by value.
    Value,
}

#[derive(Clone, Copy)]
struct BinSite {
    region: (usize, usize),
    op: (usize, usize),
    lhs: (usize, usize),
    rhs: (usize, usize),
    class: BinClass,
    /// A `let` inside (a let chain): cannot be moved into a `match`.
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
}

impl Finder<'_> {
    fn range(&self, s: proc_macro2::Span) -> (usize, usize) {
        (self.lines.byte(s.start()), self.lines.byte(s.end()))
    }
}

fn key(lc: LineColumn) -> (usize, usize) {
    (lc.line, lc.column)
}

fn is_let(e: &syn::Expr) -> bool {
    match e {
        syn::Expr::Let(_) => true,
        syn::Expr::Binary(b) => is_let(&b.left) || is_let(&b.right),
        _ => false,
    }
}

impl<'ast> Visit<'ast> for Finder<'_> {
    fn visit_expr_binary(&mut self, e: &'ast syn::ExprBinary) {
        use syn::BinOp::*;
        let class = match e.op {
            Eq(_) | Ne(_) | Lt(_) | Le(_) | Gt(_) | Ge(_) => BinClass::Compare,
            And(_) | Or(_) => BinClass::Lazy,
            AddAssign(_) | SubAssign(_) | MulAssign(_) | DivAssign(_) | RemAssign(_)
            | BitXorAssign(_) | BitAndAssign(_) | BitOrAssign(_) | ShlAssign(_) | ShrAssign(_) => {
                BinClass::Assign
            }
            _ => BinClass::Value,
        };
        let site = BinSite {
            region: self.range(e.span()),
            op: self.range(e.op.span()),
            lhs: self.range(e.left.span()),
            rhs: self.range(e.right.span()),
            class,
            has_let: is_let(&e.left) || is_let(&e.right),
        };
        self.sites.binary.insert(key(e.op.span().start()), site);
        syn::visit::visit_expr_binary(self, e);
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

enum Variant {
    /// The region's text as it is, with this byte range replaced by this text.
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
    /// A binary operation: its mutants replace the operator.
    Binary(BinClass),
    /// A unary operation: its mutants delete the operator.
    Unary,
}

struct Node {
    start: usize,
    end: usize,
    kind: Kind,
    site: Option<BinSite>,
    /// Unary: the operand's range.
    operand: (usize, usize),
    point_text: String,
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

    fn emit_replacing(
        &mut self,
        lo: usize,
        hi: usize,
        kids: &[usize],
        a: usize,
        b: usize,
        t: &str,
    ) {
        self.emit(lo, a, kids);
        self.out.push_str(t);
        self.emit(b, hi, kids);
    }

    fn switch(&mut self, id: u32) {
        self.out.push_str(&format!("if crate::__mutant({id}) {{ "));
    }

    fn node(&mut self, k: usize) {
        let begin = self.out.len();
        let kids = self.nodes[k].kids.clone();
        let (start, end, kind) = (self.nodes[k].start, self.nodes[k].end, self.nodes[k].kind);
        let variants: Vec<(u32, Variant)> = std::mem::take(&mut self.nodes[k].variants);
        let ids: Vec<u32> = variants.iter().map(|v| v.0).collect();
        match kind {
            Kind::Point => {
                let t = self.nodes[k].point_text.clone();
                self.out.push_str(&t);
            }
            Kind::Guard | Kind::Struct => {
                self.out.push('(');
                for (id, v) in &variants {
                    self.switch(*id);
                    let b = self.out.len();
                    match v {
                        Variant::Whole(t) => self.out.push_str(t),
                        Variant::Replace(x, y, t) => {
                            self.emit_replacing(start, end, &kids, *x, *y, t)
                        }
                    }
                    self.ranges.push((b, self.out.len(), vec![*id]));
                    self.out.push_str(" } else ");
                }
                self.out.push_str("{ ");
                self.emit(start, end, &kids);
                self.out.push_str(" })");
            }
            Kind::Binary(class) => {
                let site = self.nodes[k].site.expect("a binary node has its site");
                let op = self.src[site.op.0..site.op.1].to_string();
                let new_op = |v: &Variant| match v {
                    Variant::Replace(_, _, t) | Variant::Whole(t) => t.clone(),
                };
                match class {
                    BinClass::Compare | BinClass::Value => {
                        let (amp, star) = if class == BinClass::Compare {
                            ("&", "*")
                        } else {
                            ("", "")
                        };
                        self.out.push_str(&format!("(match ({amp}("));
                        self.emit(site.lhs.0, site.lhs.1, &kids);
                        self.out.push_str(&format!("), {amp}("));
                        self.emit(site.rhs.0, site.rhs.1, &kids);
                        self.out.push_str(")) { (__l, __r) => ");
                        for (id, v) in &variants {
                            self.switch(*id);
                            let b = self.out.len();
                            self.out
                                .push_str(&format!("{star}__l {} {star}__r", new_op(v)));
                            self.ranges.push((b, self.out.len(), vec![*id]));
                            self.out.push_str(" } else ");
                        }
                        self.out
                            .push_str(&format!("{{ {star}__l {op} {star}__r }} }})"));
                    }
                    BinClass::Lazy => {
                        self.out.push_str("(match (");
                        self.emit(site.lhs.0, site.lhs.1, &kids);
                        self.out.push_str(") { __l => ");
                        for (id, v) in &variants {
                            self.switch(*id);
                            let b = self.out.len();
                            self.out.push_str(&format!("__l {} (", new_op(v)));
                            self.emit(site.rhs.0, site.rhs.1, &kids);
                            self.out.push(')');
                            self.ranges.push((b, self.out.len(), vec![*id]));
                            self.out.push_str(" } else ");
                        }
                        self.out.push_str(&format!("{{ __l {op} ("));
                        self.emit(site.rhs.0, site.rhs.1, &kids);
                        self.out.push_str(") } })");
                    }
                    BinClass::Assign => {
                        self.out.push('(');
                        for (id, v) in &variants {
                            self.switch(*id);
                            let b = self.out.len();
                            let t = new_op(v);
                            self.emit_replacing(start, end, &kids, site.op.0, site.op.1, &t);
                            self.ranges.push((b, self.out.len(), vec![*id]));
                            self.out.push_str(" } else ");
                        }
                        self.out.push_str("{ ");
                        self.emit(start, end, &kids);
                        self.out.push_str(" })");
                    }
                }
            }
            Kind::Unary => {
                let (os, oe) = (self.nodes[k].operand.0, self.nodes[k].operand.1);
                let op = self.src[start..os].trim().to_string();
                self.out.push_str("(match (");
                self.emit(os, oe, &kids);
                self.out.push_str(") { __v => ");
                for (id, _) in &variants {
                    self.switch(*id);
                    self.out.push_str("__v } else ");
                }
                self.out.push_str(&format!("{{ {op}__v }} }})"));
            }
        }
        self.nodes[k].variants = variants;
        self.ranges.push((begin, self.out.len(), ids));
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
    };
    finder.visit_file(&file);
    let sites = finder.sites;

    // Groups: (start, end, kind) → node.
    let mut nodes: Vec<Node> = Vec::new();
    let mut group: HashMap<(usize, usize, Kind), usize> = HashMap::new();
    let mut add = |nodes: &mut Vec<Node>,
                   start: usize,
                   end: usize,
                   kind: Kind,
                   site: Option<BinSite>,
                   operand: (usize, usize),
                   id: u32,
                   v: Variant| {
        let i = *group.entry((start, end, kind)).or_insert_with(|| {
            nodes.push(Node {
                start,
                end,
                kind,
                site,
                operand,
                point_text: String::new(),
                variants: Vec::new(),
                kids: Vec::new(),
            });
            nodes.len() - 1
        });
        nodes[i].variants.push((id, v));
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
            "FnValue" => nodes.push(Node {
                start: at(&m.span.start),
                end: at(&m.span.start),
                kind: Kind::Point,
                site: None,
                operand: (0, 0),
                point_text: format!("if crate::__mutant({id}) {{ return {}; }} ", m.replacement),
                variants: vec![(id, Variant::Whole(String::new()))],
                kids: Vec::new(),
            }),
            "BinaryOperator" => match sites.binary.get(&k) {
                Some(s) if !s.has_let => add(
                    &mut nodes,
                    s.region.0,
                    s.region.1,
                    Kind::Binary(s.class),
                    Some(*s),
                    (0, 0),
                    id,
                    Variant::Whole(m.replacement.clone()),
                ),
                _ => unplaced.push(id),
            },
            "UnaryOperator" => match sites.unary.get(&k) {
                Some(&(region, _, operand)) => add(
                    &mut nodes,
                    region.0,
                    region.1,
                    Kind::Unary,
                    None,
                    operand,
                    id,
                    Variant::Whole(String::new()),
                ),
                None => unplaced.push(id),
            },
            "MatchArmGuard" => match sites.guard.get(&k) {
                Some(&(s, e)) => add(
                    &mut nodes,
                    s,
                    e,
                    Kind::Guard,
                    None,
                    (0, 0),
                    id,
                    Variant::Whole(m.replacement.clone()),
                ),
                None => unplaced.push(id),
            },
            "MatchArm" => match sites.arm.get(&k) {
                // A deleted arm is an arm that never matches: its guard is false.
                Some(ArmSite {
                    guard: Some((s, e)),
                    ..
                }) => add(
                    &mut nodes,
                    *s,
                    *e,
                    Kind::Guard,
                    None,
                    (0, 0),
                    id,
                    Variant::Whole("false".into()),
                ),
                // Without a `_` arm the match would no longer be exhaustive: cargo-mutants
                // builds it, and finds it unviable.
                Some(ArmSite {
                    catch_all: false,
                    guard: None,
                    ..
                }) => unplaced.push(id),
                Some(ArmSite {
                    pat_end,
                    guard: None,
                    ..
                }) => nodes.push(Node {
                    start: *pat_end,
                    end: *pat_end,
                    kind: Kind::Point,
                    site: None,
                    operand: (0, 0),
                    point_text: format!(" if !crate::__mutant({id})"),
                    variants: vec![(id, Variant::Whole(String::new()))],
                    kids: Vec::new(),
                }),
                None => unplaced.push(id),
            },
            "StructField" => match sites.field.get(&k) {
                Some(&(s, e)) => {
                    let (a, b) = (at(&m.span.start), at(&m.span.end));
                    add(
                        &mut nodes,
                        s,
                        e,
                        Kind::Struct,
                        None,
                        (0, 0),
                        id,
                        Variant::Replace(a, b, String::new()),
                    )
                }
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
        Kind::Binary(_) => 3,
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
