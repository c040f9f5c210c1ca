"""The patchgen DSL: a `PatchConfig` per upstream modeling file and the patches registered on it.

A model family's `patches.py` builds one module-level `config = PatchConfig(source_module=...)` and
registers replacements with the decorators below. Registration only records text (the replacement's
source, with the DSL decorators removed and `name_map` applied); `spindle.patchgen.generator` applies
it to the upstream source. Nothing here imports or modifies the upstream module.
"""

from __future__ import annotations

import ast
import inspect
import io
import sys
import textwrap
import tokenize
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

# The verbs that replace an upstream definition (one target each); the others add or drop imports/code.
DEFINITION_KINDS = ("replace_class", "override_method", "replace_function", "modify_init", "delegate_method")
DSL_DECORATORS = frozenset({*DEFINITION_KINDS, "add_helper"})


class PatchgenError(ValueError):
    """A patch config that cannot be applied (missing target, changed signature, bad input)."""


@dataclass(frozen=True)
class Patch:
    """One recorded patch. `code` is Python source at column 0 (empty for drop_import_names; for
    delegate_method, the `from module import function` statement that brings the delegate in)."""

    kind: str
    target: str
    code: str
    description: str
    origin: str  # "spindle/models/x/patches.py:LINE", for error messages
    keep_decorators: bool = True
    allow_signature_change: bool = False

    @property
    def label(self) -> str:
        return f"{self.kind} {self.target!r}"


def display_path(path: str | Path) -> str:
    """`path` relative to the first folder above its package (e.g. spindle/models/qwen3/patches.py).

    Package-relative rather than absolute so generated headers and messages read the same in any
    checkout (and in a temporary copy of one).
    """
    path = Path(path).resolve()
    top = path.parent
    while (top / "__init__.py").exists():
        top = top.parent
    return path.relative_to(top).as_posix()


def apply_name_map(code: str, name_map: Mapping[str, str] | None) -> str:
    """Rewrite every identifier starting with a key of `name_map` to start with its value instead.

    Works on tokens, so strings, comments and formatting are untouched: with {"Qwen3": "Llama"},
    `Qwen3Model(config)` becomes `LlamaModel(config)`, the comment `# Qwen3 only` stays. Longest key first.
    """
    if not name_map:
        return code
    keys = sorted(name_map, key=len, reverse=True)
    lines = code.splitlines(keepends=True)
    edits: list[tuple[int, int, int, str]] = []
    for tok in tokenize.generate_tokens(io.StringIO(code).readline):
        if tok.type != tokenize.NAME:
            continue
        for key in keys:
            if tok.string.startswith(key):
                edits.append((tok.start[0] - 1, tok.start[1], tok.end[1], name_map[key] + tok.string[len(key) :]))
                break
    for row, start, end, text in reversed(edits):
        lines[row] = lines[row][:start] + text + lines[row][end:]
    return "".join(lines)


def map_target(target: str, name_map: Mapping[str, str] | None) -> str:
    """Apply `name_map` to each dotted part of a target ("Qwen3Model.forward" -> "LlamaModel.forward")."""
    if not name_map:
        return target
    keys = sorted(name_map, key=len, reverse=True)
    parts = []
    for part in target.split("."):
        key = next((k for k in keys if part.startswith(k)), None)
        parts.append(part if key is None else name_map[key] + part[len(key) :])
    return ".".join(parts)


def _is_dsl_decorator(node: ast.expr) -> bool:
    func = node.func if isinstance(node, ast.Call) else node
    return isinstance(func, ast.Attribute) and func.attr in DSL_DECORATORS


def replacement_source(obj: Callable | type) -> tuple[str, str]:
    """(source at column 0 without the DSL decorators, "file:line") of a function or class."""
    try:
        lines, lineno = inspect.getsourcelines(obj)
        path = inspect.getsourcefile(obj) or "<unknown>"
    except (OSError, TypeError) as e:
        raise PatchgenError(
            f"patchgen: cannot read the source of {obj!r} ({e}); replacements must be defined in a .py file"
        ) from e
    code = textwrap.dedent("".join(lines))
    node: Any = ast.parse(code).body[0]  # the decorated def / class
    drop: set[int] = set()
    for dec in node.decorator_list:
        if _is_dsl_decorator(dec):
            drop.update(range(dec.lineno - 1, dec.end_lineno))
    kept = [line for i, line in enumerate(code.splitlines(keepends=True)) if i not in drop]
    return "".join(kept), f"{display_path(path)}:{lineno}"


class PatchConfig:
    """Patches for one upstream module, written to `generated/<target>.py` next to the config file.

    source_module: dotted module whose installed source is patched (read from disk, never imported).
    target: the generated module's name (default `patched_<last part of source_module>`).
    """

    def __init__(self, source_module: str, target: str | None = None, *, description: str = ""):
        if not source_module or not all(p.isidentifier() for p in source_module.split(".")):
            raise PatchgenError(f"PatchConfig: source_module={source_module!r} is not a dotted module name")
        self.source_module = source_module
        self.target = target or "patched_" + source_module.rsplit(".", 1)[-1]
        if not self.target.isidentifier():
            raise PatchgenError(f"PatchConfig: target={self.target!r} must be a module name (letters, digits, _)")
        self.description = description
        self.patches: list[Patch] = []

    # -- definitions: decorators on the replacement, or `replacement=` for a function defined elsewhere

    def replace_class(self, name: str, *, description: str = "", replacement=None, name_map=None):
        """Replace upstream class `name` with the decorated class (renamed to `name`).

        The upstream class's decorators are dropped; the replacement's own (non-patchgen) ones are kept.
        """
        return self._definition("replace_class", name, description, replacement, name_map, keep_decorators=False)

    def override_method(
        self,
        target: str,
        *,
        description: str = "",
        replacement=None,
        name_map=None,
        keep_decorators: bool = True,
        allow_signature_change: bool = False,
    ):
        """Replace method `Class.method` with the decorated function (renamed to `method`).

        The upstream method's decorators stay on top (e.g. `@can_return_tuple`) unless keep_decorators=False.
        The replacement must have upstream's signature (parameter names, kinds, defaults) unless
        allow_signature_change=True.
        """
        if target.count(".") != 1:
            raise PatchgenError(f"override_method: target {target!r} must be 'Class.method'")
        return self._definition(
            "override_method", target, description, replacement, name_map, keep_decorators, allow_signature_change
        )

    def replace_function(
        self,
        name: str,
        *,
        description: str = "",
        replacement=None,
        name_map=None,
        keep_decorators: bool = True,
        allow_signature_change: bool = False,
    ):
        """Replace module-level function `name`; same rules as override_method."""
        return self._definition(
            "replace_function", name, description, replacement, name_map, keep_decorators, allow_signature_change
        )

    def modify_init(self, class_name: str, *, description: str = "", replacement=None, name_map=None):
        """Wrap `class_name.__init__`: the decorated function's body runs after the upstream body.

        The replacement declares the same parameters as the upstream `__init__` (they are in scope);
        the upstream body stays as it is, so the diff shows only the appended lines.
        """
        return self._definition("modify_init", class_name, description, replacement, name_map)

    def delegate_method(self, target: str, *, to: Callable, description: str = ""):
        """Keep upstream `Class.method` (decorators, signature, docstring) and make its body a call of `to`.

        The generated body is `return to(self, name=name, ..., **kwargs)` with every upstream parameter
        passed on by name, and `from <to's module> import <to>` is added: one shared function serves
        every model whose method it fits, and neither the config nor the generated module restates it.
        `to` must be a module-level function of an importable module (not of the config itself).
        """
        if target.count(".") != 1:
            raise PatchgenError(f"delegate_method: target {target!r} must be 'Class.method'")
        origin = _caller_origin()
        module, name = getattr(to, "__module__", None), getattr(to, "__qualname__", None)
        if not module or not name or getattr(sys.modules.get(module), name, None) is not to:
            raise PatchgenError(
                f"delegate_method {target!r} ({origin}): `to` must be a module-level function of an importable "
                f"module (e.g. in spindle/models/shared/), got {to!r}"
            )
        if module.startswith(CONFIG_MODULE_PREFIX):
            raise PatchgenError(
                f"delegate_method {target!r} ({origin}): {name} is defined in the patch config, which generated code "
                "cannot import; move it to a module (e.g. spindle/models/shared/) or use override_method"
            )
        code = f"from {module} import {name}\n"
        self.patches.append(Patch("delegate_method", target, code, description, origin))

    def _definition(
        self, kind, target, description, replacement, name_map, keep_decorators=True, allow_signature_change=False
    ):
        def register(obj):
            code, origin = replacement_source(obj)
            is_class = isinstance(obj, type)
            if is_class != (kind == "replace_class"):
                want = "a class" if kind == "replace_class" else "a function"
                raise PatchgenError(f"{kind} {target!r} ({origin}): the replacement must be {want}, got {obj!r}")
            self.patches.append(
                Patch(
                    kind,
                    target,  # already this module's name; name_map is for the replacement's code
                    apply_name_map(code, name_map),
                    description,
                    origin,
                    keep_decorators,
                    allow_signature_change,
                )
            )
            return obj

        return register if replacement is None else register(replacement)

    # -- module-level additions

    def add_import(self, module: str, names: list[str] | tuple[str, ...] | None = None, *, alias: str | None = None):
        """Add `from module import names...` (or `import module [as alias]`) after upstream's imports."""
        if names and alias:
            raise PatchgenError(f"add_import({module!r}): pass names=... or alias=..., not both")
        if names:
            code = f"from {module} import {', '.join(names)}\n"
        else:
            code = f"import {module}" + (f" as {alias}" if alias else "") + "\n"
        try:
            ast.parse(code)
        except SyntaxError as e:
            raise PatchgenError(f"add_import: {code.strip()!r} is not a valid import ({e.msg})") from e
        self.patches.append(Patch("add_import", module, code, "", _caller_origin()))

    def add_helper(self, obj=None, *, description: str = "", name_map=None):
        """Add a module-level function or class (decorator, or `add_helper(fn)`) after the imports."""

        def register(obj):
            code, origin = replacement_source(obj)
            self.patches.append(Patch("add_helper", obj.__name__, apply_name_map(code, name_map), description, origin))
            return obj

        return register if obj is None else register(obj)

    def add_post_import_block(self, code: str, *, description: str = "", name_map=None):
        """Add raw module-level code (e.g. a try/except import fallback) right after the imports."""
        code = textwrap.dedent(code).strip("\n") + "\n"
        try:
            ast.parse(code)
        except SyntaxError as e:
            raise PatchgenError(f"add_post_import_block: the code does not parse (line {e.lineno}: {e.msg})") from e
        self.patches.append(
            Patch("add_post_import_block", "module", apply_name_map(code, name_map), description, _caller_origin())
        )

    def drop_import_names(self, *names: str, description: str = ""):
        """Remove names from upstream's module-level imports (the statement goes when it is left empty)."""
        origin = _caller_origin()
        for name in names:
            self.patches.append(Patch("drop_import_names", name, "", description, origin))

    # -- reuse

    def extend(self, other: PatchConfig, *, name_map: Mapping[str, str] | None = None) -> None:
        """Register every patch of `other` here, with `name_map` applied to targets and code.

        How a sibling model reuses a family's patches: `config.extend(qwen3.config, name_map={"Qwen3": "Llama"})`.
        """
        for p in other.patches:
            self.patches.append(
                replace(p, target=map_target(p.target, name_map), code=apply_name_map(p.code, name_map))
            )


# The private module name under which `spindle.patchgen.check.load_config` runs a config file.
CONFIG_MODULE_PREFIX = "_spindle_patchgen_"


def _caller_origin() -> str:
    """ "file:line" of the config line that called the DSL method calling this."""
    frame = sys._getframe(2)
    return f"{display_path(frame.f_code.co_filename)}:{frame.f_lineno}"
