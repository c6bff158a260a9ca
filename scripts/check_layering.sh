#!/usr/bin/env bash
# The layering check (docs/architecture.md "Layering"): every #include "..." of a C++/CUDA source
# must stay inside its own folder or point at a folder that its rule lists. The rules are read
# from the block between `<!-- layering:begin -->` and `<!-- layering:end -->` of
# docs/architecture.md, one line per folder:
#   <folder>: <what it may include> ...      (folders, or single files such as a header)
#   <folder>: *                             (anything: tests)
# A file belongs to the longest folder of the rules that contains it; an include belongs to its
# own folder when it resolves to the same longest folder, else it must start with a listed entry.
# Includes that resolve to no rule folder (abseil, gtest, system headers) are not checked; a
# source file under no rule folder is an error (every folder must have a rule).
# Usage: scripts/check_layering.sh [ROOT]   (ROOT: the tree to check, default this checkout)
# Exit status: 0 when clean, 1 with one line per violation ("file:line: ..."), 2 on a bad rule
# block.
set -euo pipefail

ROOT="${1:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}"
exec python3 - "$ROOT" <<'PYTHON'
import os
import re
import sys

root = sys.argv[1]
doc = os.path.join(root, "docs", "architecture.md")
try:
    text = open(doc, encoding="utf-8").read()
except OSError as e:
    print(f"check_layering: cannot read {doc}: {e.strerror}", file=sys.stderr)
    sys.exit(2)
m = re.search(r"<!-- layering:begin -->(.*?)<!-- layering:end -->", text, re.S)
if not m:
    print(f"check_layering: {doc} has no <!-- layering:begin --> ... <!-- layering:end --> block",
          file=sys.stderr)
    sys.exit(2)
rules = {}
for raw in m.group(1).splitlines():
    line = raw.split("#", 1)[0].strip()
    if not line or line.startswith("```"):
        continue
    if ":" not in line:
        print(f"check_layering: bad rule line (expected 'folder: entries'): {raw!r}",
              file=sys.stderr)
        sys.exit(2)
    folder, allowed = line.split(":", 1)
    folder = folder.strip().rstrip("/")
    if folder in rules:
        print(f"check_layering: two rules for {folder}", file=sys.stderr)
        sys.exit(2)
    rules[folder] = [a.rstrip("/") for a in allowed.split()]
if not rules:
    print("check_layering: the rule block is empty", file=sys.stderr)
    sys.exit(2)


def owner(path):
    """The longest rule folder that contains `path`, or None."""
    best = None
    for folder in rules:
        if path == folder or path.startswith(folder + "/"):
            if best is None or len(folder) > len(best):
                best = folder
    return best


def covered(path, entry):
    return path == entry or path.startswith(entry + "/")


include_re = re.compile(r'^\s*#\s*include\s*"([^"]+)"')
extensions = (".h", ".cc", ".cu", ".cuh")
violations = []
checked = 0
for dirpath, dirnames, filenames in os.walk(root):
    rel_dir = os.path.relpath(dirpath, root)
    if rel_dir == ".":
        rel_dir = ""
    # Build trees and git metadata are not sources.
    dirnames[:] = sorted(d for d in dirnames
                         if not (rel_dir == "" and (d == "build" or d.startswith("build-")))
                         and not d.startswith("."))
    for name in sorted(filenames):
        if not name.endswith(extensions):
            continue
        rel = os.path.join(rel_dir, name) if rel_dir else name
        mine = owner(rel)
        if mine is None:
            violations.append(f"{rel}: no layering rule covers this folder "
                              f"(add one to docs/architecture.md)")
            continue
        allowed = rules[mine]
        checked += 1
        with open(os.path.join(root, rel), encoding="utf-8", errors="replace") as f:
            for number, text_line in enumerate(f, 1):
                im = include_re.match(text_line)
                if not im:
                    continue
                target = os.path.normpath(im.group(1))
                theirs = owner(target)
                if theirs is None or theirs == mine or "*" in allowed:
                    continue
                if any(covered(target, entry) for entry in allowed):
                    continue
                listed = " ".join(allowed) if allowed else "(nothing outside itself)"
                violations.append(
                    f"{rel}:{number}: includes \"{im.group(1)}\" ({theirs}); "
                    f"rule \"{mine}: {listed}\" does not allow it")
for v in violations:
    print(v)
if violations:
    print(f"check_layering: {len(violations)} violation(s) of the layering in docs/architecture.md",
          file=sys.stderr)
    sys.exit(1)
print(f"check_layering: {checked} files follow the layering of docs/architecture.md")
PYTHON
