#!/usr/bin/env python3
"""Import circles between the files of a Rust source tree (default: src/, the tools crate:
src/cli/ is the binary's, the rest the library's). Usage: scripts/check_import_circles.py [DIR]

A file imports another when one of its `use` declarations (`pub use` included), or a path
written out in its code (`super::a::f()`, `crate::a::B`, `cachalot_tools::a::B`, or in a
mod.rs/lib.rs/main.rs a declared child module's `child::f()`), names an item of the other's
module. Prints every pair of files that import each other, and every `use` that reaches an
item through a re-export instead of naming its defining module; exits 1 if there are any.
"""
import re
import sys
from pathlib import Path

root = Path(sys.argv[1] if len(sys.argv) > 1 else "src")
LIB = "cachalot_tools"

def strip(text):
    text = re.sub(r"//[^\n]*", "", text)
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    text = re.sub(r'"(\\.|[^"\\])*"', '""', text)
    # tests modules are not part of the import graph of the product
    m = re.search(r"#\[cfg\(test\)\]\s*mod tests\s*\{", text)
    return text[: m.start()] if m else text

files = {}   # module path (tuple) -> file
for f in sorted(root.rglob("*.rs")):
    rel = f.relative_to(root).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "mod":
        parts = parts[:-1]
    if parts == ["lib"]:
        parts = []
    if parts == ["main"]:
        parts = ["<bin>"]
    elif parts and parts[0] == "cli":
        parts = ["<bin>"] + parts   # src/cli is the binary's
    files[tuple(parts)] = f

def is_dir_module(mod):
    f = files[mod]
    return f.name in ("mod.rs", "lib.rs", "main.rs")

def expand(tree):
    """`a::{b, c::{d, e}}` -> [a::b, a::c::d, a::c::e]"""
    tree = tree.strip()
    i = tree.find("{")
    if i < 0:
        return [tree.split(" as ")[0].strip()]
    head, body = tree[:i], tree[i + 1 : tree.rfind("}")]
    out, depth, cur = [], 0, ""
    for ch in body:
        if ch == "," and depth == 0:
            out.append(cur); cur = ""; continue
        depth += ch == "{"
        depth -= ch == "}"
        cur += ch
    out.append(cur)
    res = []
    for o in out:
        if o.strip():
            for e in expand(o):
                res.append(head + e if e != "self" else head.rstrip(":"))
    return res

pub_uses = {}  # module -> {name: path it re-exports}
children_of = {}  # module -> the child modules its file declares
for mod, f in files.items():
    children_of[mod] = set(re.findall(r"\bmod\s+(\w+)\s*;", strip(f.read_text())))
uses = {}      # module -> list of (path, is_use)
for mod, f in files.items():
    text = strip(f.read_text())
    lst = []
    for m in re.finditer(r"\b(pub(?:\([^)]*\))?\s+)?use\s+([^;]+);", text):
        for p in expand(m.group(2)):
            lst.append((p, True))
            if m.group(1):
                pub_uses.setdefault(mod, {})[p.split("::")[-1]] = p
    body = re.sub(r"\b(pub(?:\([^)]*\))?\s+)?use\s+[^;]+;", "", text)
    for m in re.finditer(r"(?<![\w:])((?:super|crate|%s)(?:::\w+)+)" % LIB, body):
        lst.append((m.group(1), False))
    if is_dir_module(mod):
        children = re.findall(r"\bmod\s+(\w+)\s*;", text)
        for c in children:
            for m in re.finditer(r"(?<![\w:])(%s(?:::\w+)+)" % c, body):
                lst.append(("self::" + m.group(1), False))
    uses[mod] = lst

def base(mod):
    """The module `self` names in `mod`'s file."""
    return mod

def resolve(mod, path):
    """The module (file) a path's item lives in, following the path as far as files go."""
    segs = path.split("::")
    if segs[0] == "crate":
        cur = ("<bin>",) if mod and mod[0] == "<bin>" else ()
        segs = segs[1:]
    elif segs[0] == LIB:
        cur = ()
        segs = segs[1:]
    elif segs[0] in ("super", "self"):
        cur = mod
        while segs and segs[0] in ("super", "self"):
            if segs[0] == "super":
                cur = cur[:-1]
            segs = segs[1:]
    elif segs[0] in children_of.get(mod, ()):
        cur = mod
    else:
        return None  # an outside crate
    for s in segs:
        if cur + (s,) in files:
            cur = cur + (s,)
        else:
            break
    return cur

problems = 0
edges = {}
for mod, lst in uses.items():
    for path, is_use in lst:
        target = resolve(mod, path)
        if target is None or target == mod or target not in files:
            continue
        edges.setdefault(mod, set()).add(target)
        # an item reached through a re-export of a file that does not define it
        name = path.split("::")[-1]
        if is_use and name in pub_uses.get(target, {}) and not path.startswith(LIB) \
                and not (mod[:1] == ("<bin>",) and target[:1] != ("<bin>",)):
            print(f"{files[mod]}: `{path}` names a re-export of {files[target]}, "
                  f"not its defining module ({pub_uses[target][name]})")
            problems += 1
seen = set()
for a, bs in edges.items():
    for b in bs:
        if a in edges.get(b, ()) and (b, a) not in seen:
            seen.add((a, b))
            print(f"circle: {files[a]} <-> {files[b]}")
            problems += 1
print(f"{len(files)} files, {sum(len(v) for v in edges.values())} file imports, {problems} problems")
sys.exit(1 if problems else 0)
