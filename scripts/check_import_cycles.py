#!/usr/bin/env python3
"""Lists the pairs of source files of a crate that import each other.

A file *imports* another when one of its paths that starts at `crate::` or `super::` names the
other's module (`use crate::a::b::X`, `use super::b::X`, `use super::X`, or the same paths
written inline, `crate::a::b::f()`), resolved to the deepest module that has a file of its own.
A module's own children (`mod child;`, `pub use child::X`, `self::child::X`) are its module
tree, not imports, and are not counted unless `--tree` is given; a child's paths to its parent
(`super::X`) are always counted. It also lists the paths that reach an item through a
re-export (`crate::Stats` for `crate::stats::Stats`): inside the crate a path names the module
that defines the item. Exits 1 when a pair or such a path is found.

    python3 scripts/check_import_cycles.py [--tree] [SRC_DIR, default allocator/src]
"""

import os
import re
import sys


def module_of(root, path):
    rel = os.path.relpath(path, root)[:-3].split(os.sep)
    if rel[-1] in ("lib", "main", "mod"):
        rel = rel[:-1]
    return tuple(rel)


def strip_comments(text):
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


def inline_modules(text):
    """The inline modules of a file (`mod tests { ... }`): (name, start, end) spans of text."""
    spans = []
    for m in re.finditer(r"\bmod\s+(\w+)\s*\{", text):
        depth, i = 1, m.end()
        while depth and i < len(text):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        spans.append((m.group(1), m.end(), i))
    return spans


def use_paths(text, positions=False):
    """Every path of every `use` item, braces expanded (`a::{b, c::d}` → `a::b`, `a::c::d`);
    with `positions`, each with the offset of its `use`."""
    out = []

    def walk(tree, prefix):
        depth, start, items = 0, 0, []
        for i, ch in enumerate(tree):
            if ch == "{":
                depth += 1
            elif ch == "}":
                depth -= 1
            elif ch == "," and depth == 0:
                items.append(tree[start:i])
                start = i + 1
        items.append(tree[start:])
        for item in items:
            item = item.strip()
            if not item:
                continue
            brace = item.find("{")
            if brace >= 0:
                walk(item[brace + 1 : item.rindex("}")], prefix + item[:brace])
            else:
                out.append((at, prefix + re.sub(r"\s+as\s+\w+$", "", item)))

    for m in re.finditer(r"\buse\s+([^;]+);", text):
        at = m.start()
        walk(re.sub(r"\s+", " ", m.group(1)), "")
    found = [(at, re.sub(r"\s", "", p)) for at, p in out]
    return found if positions else [p for _, p in found]


def main():
    args = sys.argv[1:]
    tree = "--tree" in args
    args = [a for a in args if a != "--tree"]
    root = args[0] if args else "allocator/src"
    files = {}
    for dirpath, _, names in os.walk(root):
        for name in names:
            if name.endswith(".rs"):
                path = os.path.join(dirpath, name)
                files[module_of(root, path)] = path
    modules = set(files)

    def resolve(path):
        for n in range(len(path), -1, -1):
            if path[:n] in modules:
                return path[:n]
        return ()

    def defines(target, name):
        """Whether `target` defines `name`, or re-exports it from outside the crate (as the
        `sync` shim does with `std::sync` and loom): then `target` is where the crate names it."""
        text = strip_comments(open(files[target], encoding="utf-8").read())
        item = r"\b(?:struct|enum|union|trait|type|fn|const|static|mod)\s+" + re.escape(name) + r"\b"
        if re.search(item, text) or re.search(r"macro_rules!\s*" + re.escape(name) + r"\b", text):
            return True
        for used in use_paths(text):
            parts = used.split("::")
            if parts[-1] == name:
                first = parts[0]
                inside = first in ("crate", "super", "self") or target + (first,) in modules
                if not inside:
                    return True
        return False

    imports = {m: set() for m in modules}
    via_reexport = []
    for module, path in files.items():
        text = strip_comments(open(path, encoding="utf-8").read())
        paths = use_paths(text, positions=True)
        inline = re.finditer(r"(?<![\w:])((?:crate|super|self)(?:::\w+)+)", text)
        paths += [(m.start(), m.group(1)) for m in inline]
        spans = inline_modules(text)
        for at, p in paths:
            parts = [x for x in p.split("::") if x]
            if not parts:
                continue
            # Inside `mod tests { ... }`, `super` is the file's own module.
            here = list(module) + [n for n, start, end in spans if start <= at < end]
            if parts[0] == "crate":
                base, rest = [], parts[1:]
            elif parts[0] == "super":
                base, rest = here, parts
                while rest and rest[0] == "super":
                    base, rest = base[:-1], rest[1:]
            elif tree:
                # `self::child::X`, or a bare `child::X` naming one of the module's children.
                rest = parts[1:] if parts[0] == "self" else parts
                base = list(module)
                if not rest or module + (rest[0],) not in modules:
                    continue
            else:
                continue
            full = tuple(base + rest)
            target = resolve(full)
            if target != module:
                imports[module].add(target)
                name = full[len(target)] if len(full) > len(target) else None
                if name and name not in ("self", "*") and not defines(target, name):
                    via_reexport.append(f"{path}: {p} (through {files[target]})")

    pairs = sorted(
        (files[a], files[b])
        for a in modules
        for b in imports[a]
        if a < b and a in imports[b]
    )
    for a, b in pairs:
        print(f"{a} <-> {b}")
    kind = " (module trees included)" if tree else ""
    print(f"{len(pairs)} pair(s) of files in {root} import each other{kind}")
    for line in sorted(set(via_reexport)):
        print(line)
    print(f"{len(set(via_reexport))} path(s) reach an item through a re-export")
    return 1 if pairs or via_reexport else 0


if __name__ == "__main__":
    sys.exit(main())
