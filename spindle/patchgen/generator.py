"""Apply a `PatchConfig` to the installed upstream source: generated module text and its diff.

The upstream file is read from disk (`importlib.util.find_spec(...).origin`; the module is never
imported), its relative imports are made absolute, and each patch replaces or inserts whole lines at
the positions the syntax tree gives. Everything else keeps its original text and comments, so the
unified diff against upstream shows exactly the patches. The result is formatted with ruff under
fixed settings (not the repository's), which is a no-op on upstream's own (ruff-formatted) text.
"""

from __future__ import annotations

import ast
import difflib
import importlib.metadata
import importlib.util
import inspect
import io
import json
import re
import subprocess
import sys
import tokenize
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spindle.patchgen.spec import DEFINITION_KINDS, Patch, PatchConfig, PatchgenError, display_path

# Fixed formatter settings: generated files must not depend on the repository's ruff config. 119 is
# transformers' own line length, so upstream text passes through unchanged.
RUFF_SETTINGS = ("--isolated", "--line-length", "119", "--target-version", "py310")
MARKER = "# [PATCHED]"
# Patches whose code is an import statement, placed together after upstream's imports.
IMPORT_KINDS = ("add_import", "delegate_method")


@dataclass(frozen=True)
class Upstream:
    module: str
    path: Path  # the installed file
    display: str  # e.g. transformers/models/qwen3/modeling_qwen3.py
    version: str  # the distribution's version
    text: str  # relative imports already made absolute


@dataclass(frozen=True)
class Generated:
    py_path: Path
    diff_path: Path
    py_text: str
    diff_text: str


@dataclass
class _Edit:
    start: int  # first line replaced (1-based); for an insertion, the line it goes before
    end: int  # last line replaced; start - 1 for an insertion
    lines: list[str]
    patch: Patch
    order: int

    @property
    def is_insertion(self) -> bool:
        return self.end < self.start


# -- reading upstream


def read_upstream(module: str) -> Upstream:
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError) as e:
        spec, error = None, f" ({e})"
    else:
        error = ""
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        raise PatchgenError(
            f"source_module {module!r} was not found as a .py file{error}; check the name and that its package "
            "is installed (pip install -c constraints.txt ...)"
        )
    path = Path(spec.origin)
    top = module.split(".")[0]
    try:
        version = importlib.metadata.version(top)
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    root = path
    for _ in module.split("."):
        root = root.parent
    text = rewrite_relative_imports(path.read_text(encoding="utf-8"), module.rpartition(".")[0], path)
    return Upstream(module, path, path.relative_to(root).as_posix(), version, text)


_FROM_DOTS = re.compile(r"^(\s*from\s+)(\.+\s*[\w.]*)(\s+import\b)")


def rewrite_relative_imports(text: str, package: str, path: Path | str = "<source>") -> str:
    """`from ...utils import x` -> `from transformers.utils import x`, anywhere in the module, in place."""
    lines = text.splitlines(keepends=True)
    for node in ast.walk(ast.parse(text, filename=str(path))):
        if not isinstance(node, ast.ImportFrom) or node.level == 0:
            continue
        absolute = importlib.util.resolve_name("." * node.level + (node.module or ""), package)
        i = node.lineno - 1
        # a module path has no backslashes, so it is safe in the replacement template
        new, count = _FROM_DOTS.subn(rf"\g<1>{absolute}\g<3>", lines[i], count=1)
        if count != 1:
            raise PatchgenError(f"{path}:{node.lineno}: cannot rewrite the relative import {lines[i].strip()!r}")
        lines[i] = new
    return "".join(lines)


# -- locating targets


def _names(nodes, types) -> dict[str, Any]:  # name -> the ClassDef / FunctionDef node
    return {n.name: n for n in nodes if isinstance(n, types)}


_FUNCS = (ast.FunctionDef, ast.AsyncFunctionDef)


class _Index:
    def __init__(self, upstream: Upstream, tree: ast.Module):
        self.upstream = upstream
        self.classes = _names(tree.body, ast.ClassDef)
        self.functions = _names(tree.body, _FUNCS)
        self.imports = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]

    def missing(self, patch: Patch, what: str, name: str, candidates) -> PatchgenError:
        close = difflib.get_close_matches(name, list(candidates), n=3)
        hint = f"; close names upstream: {', '.join(close)}" if close else ""
        return PatchgenError(
            f"patch {patch.label} ({patch.origin}): {what} {name!r} not found in {self.upstream.module} "
            f"({self.upstream.path}){hint}. If transformers renamed or removed it, update the patch "
            "(see docs/patchgen.md, 'When transformers moves')"
        )

    def cls(self, patch: Patch, name: str) -> ast.ClassDef:
        if name not in self.classes:
            raise self.missing(patch, "class", name, self.classes)
        return self.classes[name]

    def method(self, patch: Patch, class_name: str, name: str):
        methods = _names(self.cls(patch, class_name).body, _FUNCS)
        if name not in methods:
            raise self.missing(patch, f"method of class {class_name!r}:", name, methods)
        return methods[name]

    def function(self, patch: Patch, name: str):
        if name not in self.functions:
            raise self.missing(patch, "module-level function", name, self.functions)
        return self.functions[name]


# -- building edits


def _first_line(node) -> int:
    return min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])


def _last_line(node: ast.AST) -> int:
    """`end_lineno` (typed Optional by typeshed; `ast.parse` always sets it)."""
    end = getattr(node, "end_lineno", None)
    if end is None:
        raise PatchgenError(f"{type(node).__name__} node at line {getattr(node, 'lineno', '?')} has no end position")
    return int(end)


def _string_continuation_rows(code: str) -> set[int]:
    """0-based rows that start inside a multi-line string: re-indenting them would change the string."""
    rows: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(code).readline):
        if tok.type == tokenize.STRING and tok.end[0] > tok.start[0]:
            rows.update(range(tok.start[0], tok.end[0]))
    return rows


def _indent(code: str, prefix: str) -> list[str]:
    keep = _string_continuation_rows(code)
    return [
        line if (i in keep or not line.strip()) else prefix + line
        for i, line in enumerate(code.splitlines(keepends=True))
    ]


def _rename(code: str, node, new: str) -> str:
    """Rename the def/class header of `node` (parsed from `code`) to `new`."""
    lines = code.splitlines(keepends=True)
    i = node.lineno - 1
    keyword = "class" if isinstance(node, ast.ClassDef) else "def"
    lines[i], count = re.subn(rf"(\b{keyword}\s+){re.escape(node.name)}\b", rf"\g<1>{new}", lines[i], count=1)
    if count != 1:
        raise PatchgenError(f"cannot find the {keyword} header of {node.name!r} to rename it to {new!r}")
    return "".join(lines)


def _signature(fn) -> str:
    """Parameter names, kinds and defaults (no annotations) as text, e.g. `self, x=None, *args, **kwargs`."""
    stub: Any = ast.parse(ast.unparse(fn.args).join(("def f(", "): pass"))).body[0]  # a FunctionDef
    args = ast.fix_missing_locations(stub).args
    for a in (*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg):
        if a is not None:
            a.annotation = None
    return ast.unparse(args)


def _own_statements(fn):
    """Every node in `fn`'s body, not descending into nested functions/classes (their returns are theirs)."""
    todo = list(fn.body)
    while todo:
        node = todo.pop()
        yield node
        if not isinstance(node, (*_FUNCS, ast.ClassDef, ast.Lambda)):
            todo.extend(ast.iter_child_nodes(node))


def _marker(patch: Patch, indent: str) -> str:
    text = f"{indent}{MARKER} {patch.kind} {patch.target}"
    return text + (f": {patch.description}" if patch.description else "") + "\n"


def _check_signature(patch: Patch, upstream_fn, replacement_fn, upstream: Upstream) -> None:
    want, got = _signature(upstream_fn), _signature(replacement_fn)
    if want != got and not patch.allow_signature_change:
        raise PatchgenError(
            f"patch {patch.label} ({patch.origin}): the replacement's signature no longer matches upstream "
            f"{upstream.module} ({upstream.path}:{upstream_fn.lineno}).\n  upstream:    ({want})\n"
            f"  replacement: ({got})\nUpdate the replacement to the new upstream signature (or pass "
            "allow_signature_change=True if the difference is intended)"
        )


def _delegate_call(fn, callee: str, indent: str) -> tuple[list[str], list[str], list[str]]:
    """The body `return callee(self, a=a, ..., **kwargs)` passing on every parameter of upstream `fn`,
    by name where it can be (by position: `self`, positional-only ones, all of them before a `*args`);
    also the positional and the keyword parameter names, to check the callee can take them."""
    args = fn.args
    positional = [a.arg for a in (*args.posonlyargs, *args.args)]
    by_position = len(positional) if args.vararg else max(1, len(args.posonlyargs))
    named = [*positional[by_position:], *(a.arg for a in args.kwonlyargs)]
    star = [f"*{args.vararg.arg}"] if args.vararg else []  # only with every positional one passed by position
    items = [*positional[:by_position], *star, *(f"{n}={n}" for n in named)]
    items += [f"**{args.kwarg.arg}"] if args.kwarg else []
    inner = indent + "    "
    body = [f"{indent}return {callee}(\n", *(f"{inner}{item},\n" for item in items), f"{indent})\n"]
    return body, positional[:by_position], named


def _delegate_edits(patch: Patch, index: _Index, lines: list[str], order: int) -> list[_Edit]:
    """Upstream's decorators, signature and docstring stay; the rest of the body becomes a call of the delegate."""
    node = index.method(patch, *patch.target.split("."))
    if not (node.args.posonlyargs or node.args.args):
        raise PatchgenError(f"patch {patch.label} ({patch.origin}): upstream {patch.target} takes no `self`")
    statement: Any = ast.parse(patch.code).body[0]  # from <module> import <callee>
    module, callee = statement.module, statement.names[0].name
    body, by_position, named = _delegate_call(node, callee, " " * node.body[0].col_offset)
    try:  # the config imported it already: this only looks it up
        delegate = getattr(importlib.import_module(module), callee)
        inspect.signature(delegate).bind(*by_position, **dict.fromkeys(named))
    except (ImportError, AttributeError, TypeError) as e:
        raise PatchgenError(
            f"patch {patch.label} ({patch.origin}): {module}.{callee} cannot take upstream's parameters "
            f"({', '.join([*by_position, *named])}; {e}). Give it a parameter (or **kwargs) for each"
        ) from e
    if ast.get_docstring(node, clean=False) is not None:
        keep = _last_line(node.body[0])  # through the docstring
    else:  # through the signature: back from the first statement over the comments and blanks above it
        keep = node.body[0].lineno - 1
        while keep > node.lineno and lines[keep - 1].strip()[:1] in ("", "#"):
            keep -= 1
    indent = " " * node.col_offset
    return [
        _Edit(_first_line(node), _first_line(node) - 1, [_marker(patch, indent)], patch, order),
        _Edit(keep + 1, _last_line(node), body, patch, order),
    ]


def _definition_edit(patch: Patch, index: _Index, lines: list[str], order: int) -> list[_Edit]:
    upstream = index.upstream
    if patch.kind == "delegate_method":
        return _delegate_edits(patch, index, lines, order)
    if patch.kind == "replace_class":
        node = index.cls(patch, patch.target)
    elif patch.kind == "override_method":
        node = index.method(patch, *patch.target.split("."))
    elif patch.kind == "replace_function":
        node = index.function(patch, patch.target)
    else:  # modify_init
        node = index.method(patch, patch.target, "__init__")
    indent = " " * node.col_offset
    start = _first_line(node)
    replacement: Any = ast.parse(patch.code).body[0]  # the def / class the patch defines

    if patch.kind == "modify_init":
        _check_signature(patch, node, replacement, upstream)
        for sub in _own_statements(node):
            if isinstance(sub, ast.Return):
                raise PatchgenError(
                    f"patch {patch.label} ({patch.origin}): upstream {patch.target}.__init__ returns early "
                    f"({upstream.path}:{sub.lineno}), so appended code might not run; use override_method"
                )
        body = replacement.body
        if ast.get_docstring(replacement) is not None:
            body = body[1:]
        if not body:
            raise PatchgenError(f"patch {patch.label} ({patch.origin}): the replacement has no body to append")
        code_lines = patch.code.splitlines(keepends=True)
        keep = _string_continuation_rows(patch.code)
        column = body[0].col_offset
        body_indent = " " * node.body[0].col_offset
        appended = [
            line if (i in keep or not line.strip()) else body_indent + line[column:]
            for i, line in enumerate(code_lines)
            if body[0].lineno - 1 <= i < _last_line(body[-1])
        ]
        return [
            _Edit(start, start - 1, [_marker(patch, indent)], patch, order),
            _Edit(
                _last_line(node) + 1,
                _last_line(node),
                [_marker(patch, body_indent).rstrip("\n") + " (appended)\n", *appended],
                patch,
                order,
            ),
        ]

    if patch.kind != "replace_class":
        _check_signature(patch, node, replacement, upstream)
    name = patch.target.rsplit(".", 1)[-1]
    code = _rename(patch.code, replacement, name)
    new = [_marker(patch, indent)]
    if patch.kind != "replace_class" and patch.keep_decorators:
        new += lines[start - 1 : node.lineno - 1]
    new += _indent(code, indent)
    return [_Edit(start, _last_line(node), new, patch, order)]


def _drop_import_edits(patches: list[Patch], index: _Index, order: int) -> list[_Edit]:
    """One edit per upstream import statement that loses names; the statement goes when emptied."""
    by_stmt: dict[int, tuple[ast.Import | ast.ImportFrom, list[Patch]]] = {}
    for patch in patches:
        hits = [n for n in index.imports if any((a.asname or a.name) == patch.target for a in n.names)]
        if not hits:
            imported = [a.asname or a.name for n in index.imports for a in n.names]
            raise index.missing(patch, "module-level imported name", patch.target, imported)
        for node in hits:
            by_stmt.setdefault(id(node), (node, []))[1].append(patch)
    edits = []
    for node, ps in by_stmt.values():
        dropped = {p.target for p in ps}
        kept = [a for a in node.names if (a.asname or a.name) not in dropped]
        new = [f"{MARKER} drop_import_names {', '.join(sorted(dropped))}\n"]
        if kept:
            stmt = ast.ImportFrom(node.module, kept, 0) if isinstance(node, ast.ImportFrom) else ast.Import(kept)
            new.append(ast.unparse(stmt) + "\n")
        edits.append(_Edit(node.lineno, _last_line(node), new, ps[0], order))
    return edits


def _module_additions(patches: list[Patch], index: _Index, order: int) -> list[_Edit]:
    """Added imports, then post-import blocks and helpers (in registration order), after the last top-level import."""
    if not patches:
        return []
    if not index.imports:
        raise PatchgenError(f"{index.upstream.path}: no module-level import to place added code after")
    after = max(_last_line(n) for n in index.imports)
    new: list[str] = ["\n"]
    imports = dict.fromkeys(p.code for p in patches if p.kind in IMPORT_KINDS)  # in order, each once
    if imports:
        new.append(f"{MARKER} add_import: names used by the patched code\n")
        new += list(imports)
    for p in patches:
        if p.kind not in IMPORT_KINDS:
            new += ["\n", "\n", _marker(p, ""), *p.code.splitlines(keepends=True)]
    return [_Edit(after + 1, after, new, patches[0], order)]


def _check_overlaps(edits: list[_Edit]) -> None:
    for i, a in enumerate(edits):
        for b in edits[i + 1 :]:
            if a.patch is b.patch:
                continue
            for x, y in ((a, b), (b, a)):
                inside = (
                    x.start <= y.start <= x.end or x.start <= y.end <= x.end
                    if not y.is_insertion
                    else x.start < y.start <= x.end
                )
                if not x.is_insertion and inside:
                    raise PatchgenError(
                        f"patches {x.patch.label} ({x.patch.origin}) and {y.patch.label} ({y.patch.origin}) "
                        "touch the same upstream lines; keep one (e.g. put the method change into the replaced class)"
                    )


def _apply(lines: list[str], edits: list[_Edit]) -> list[str]:
    inserts: dict[int, list[_Edit]] = {}
    replaces: dict[int, _Edit] = {}
    for e in edits:
        if e.is_insertion:
            inserts.setdefault(e.start, []).append(e)
        else:
            replaces[e.start] = e
    out: list[str] = []
    i = 1
    while i <= len(lines) + 1:
        for e in sorted(inserts.get(i, []), key=lambda e: e.order):
            out += e.lines
        if i in replaces:
            out += replaces[i].lines
            i = replaces[i].end + 1
            continue
        if i <= len(lines):
            out.append(lines[i - 1])
        i += 1
    return out


def apply_patches(config: PatchConfig, upstream: Upstream) -> str:
    """The patched module body (no header, not yet formatted)."""
    seen: dict[str, Patch] = {}
    for p in config.patches:
        if p.kind in DEFINITION_KINDS:
            key = f"{p.target}.__init__" if p.kind == "modify_init" else p.target
            if key in seen:
                raise PatchgenError(
                    f"patches {seen[key].label} ({seen[key].origin}) and {p.label} ({p.origin}) replace the same "
                    "upstream definition; keep one"
                )
            seen[key] = p
    tree = ast.parse(upstream.text)
    index = _Index(upstream, tree)
    lines = upstream.text.splitlines(keepends=True)
    edits: list[_Edit] = []
    for order, p in enumerate(config.patches):
        if p.kind in DEFINITION_KINDS:
            edits += _definition_edit(p, index, lines, order)
    edits += _drop_import_edits([p for p in config.patches if p.kind == "drop_import_names"], index, len(edits))
    additions = [p for p in config.patches if p.kind in (*IMPORT_KINDS, "add_helper", "add_post_import_block")]
    edits += _module_additions(additions, index, -1)
    _check_overlaps(edits)
    return "".join(_apply(lines, edits))


# -- header, formatting, checks, diff


def header(config: PatchConfig, config_path: Path, upstream: Upstream) -> str:
    rule = "# " + "=" * 98 + "\n"
    out = [
        rule,
        "# GENERATED by `spindle patchgen` - DO NOT EDIT BY HAND: edit the config and regenerate.\n",
        f"#   source module:  {upstream.module} ({upstream.display})\n",
        f"#   transformers:   {upstream.version}\n"
        if upstream.module.startswith("transformers.")
        else f"#   source version: {upstream.version}\n",
        f"#   config:         {display_path(config_path)}\n",
        "#   regenerate:     spindle patchgen   (check: spindle patchgen --check)\n",
    ]
    if config.description:
        out.append(f"#   {config.description}\n")
    out.append("# Patches applied (kind, target, description):\n")
    for i, p in enumerate(config.patches, 1):
        out.append(f"#   {i}. {p.kind} {p.target}" + (f" - {p.description}" if p.description else "") + "\n")
    out.append(rule)
    return "".join(out)


def _ruff(args: list[str], text: str) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(
            [sys.executable, "-m", "ruff", *args, *RUFF_SETTINGS, "--stdin-filename", "generated.py", "-"],
            input=text,
            capture_output=True,
            text=True,
            check=False,
        )
    except OSError as e:  # pragma: no cover - the interpreter itself cannot be started
        raise PatchgenError(f"cannot run ruff ({e})") from e


def format_source(text: str, what: str) -> str:
    try:
        ast.parse(text)
    except SyntaxError as e:
        line = text.splitlines()[e.lineno - 1] if e.lineno else ""
        raise PatchgenError(f"{what}: the patched source does not parse at line {e.lineno}: {e.msg}: {line!r}") from e
    result = _ruff(["format"], text)
    if result.returncode != 0:
        if "No module named ruff" in result.stderr:
            raise PatchgenError("ruff is needed to format generated files: pip install -c constraints.txt ruff")
        raise PatchgenError(f"{what}: ruff format failed: {result.stderr.strip()}")
    return result.stdout


def undefined_names(text: str) -> list[tuple[int, str]]:
    result = _ruff(["check", "--select", "F821", "--ignore-noqa", "--output-format", "json", "--no-fix"], text)
    if result.returncode not in (0, 1):
        raise PatchgenError(f"ruff check failed: {result.stderr.strip()}")
    return [(d["location"]["row"], d["message"]) for d in json.loads(result.stdout or "[]")]


def generate(config: PatchConfig, config_path: str | Path) -> Generated:
    """Generate `generated/<target>.py` and `.diff` (as text) for the config file at `config_path`."""
    config_path = Path(config_path)
    upstream = read_upstream(config.source_module)
    out_dir = config_path.resolve().parent / "generated"
    py_path, diff_path = out_dir / f"{config.target}.py", out_dir / f"{config.target}.diff"
    what = display_path(config_path)
    left = format_source(upstream.text, upstream.display)
    py_text = format_source(header(config, config_path, upstream) + apply_patches(config, upstream), what)
    before = {msg for _, msg in undefined_names(left)}
    new = [(row, msg) for row, msg in undefined_names(py_text) if msg not in before]
    if new:
        listing = "; ".join(f"line {row}: {msg}" for row, msg in new)
        raise PatchgenError(
            f"{what}: the generated {py_path.name} uses names it does not define ({listing}); "
            "add config.add_import(...) or config.add_helper(...) for them"
        )
    diff = difflib.unified_diff(
        left.splitlines(keepends=True),
        py_text.splitlines(keepends=True),
        fromfile=f"a/{upstream.display}",
        tofile=f"b/{Path(what).parent / 'generated' / py_path.name}",
    )
    preamble = (
        f"# spindle patchgen: upstream {upstream.display} ({upstream.module.split('.')[0]} {upstream.version}, "
        "relative imports made absolute as in the generated file)\n"
        f"# -> the generated file. Every hunk is the header or a patch of {what}.\n"
    )
    return Generated(py_path, diff_path, py_text, preamble + "".join(diff))
