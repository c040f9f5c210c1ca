"""Find patch configs, regenerate their outputs, and the drift gate (`spindle patchgen --check`)."""

from __future__ import annotations

import difflib
import hashlib
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path

from spindle.patchgen.generator import Generated, generate
from spindle.patchgen.spec import CONFIG_MODULE_PREFIX, PatchConfig, PatchgenError, display_path


def discover_configs() -> list[Path]:
    """Every family's patch config: spindle/models/*/patches.py (of the spindle package being run)."""
    models = Path(__file__).resolve().parent.parent / "models"
    return sorted(models.glob("*/patches.py"))


def resolve_config_path(arg: str) -> Path:
    """A config given as a file path or as a dotted module name (spindle.models.qwen3.patches)."""
    path = Path(arg)
    if path.suffix == ".py" or "/" in arg or path.exists():
        if not path.is_file():
            raise FileNotFoundError(f"patch config {arg!r} does not exist")
        return path
    try:
        spec = importlib.util.find_spec(arg)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.origin:
        raise FileNotFoundError(f"patch config {arg!r} is neither a file nor an importable module")
    return Path(spec.origin)


def load_config(path: Path) -> PatchConfig:
    """Execute the config file (under a private module name) and return its module-level `config`."""
    path = Path(path).resolve()
    name = CONFIG_MODULE_PREFIX + hashlib.sha1(str(path).encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise PatchgenError(f"{display_path(path)}: cannot be loaded as a Python module (a .py file is needed)")
    module = importlib.util.module_from_spec(spec)
    # Registered before running: inspect.getsource on a replacement class looks its module up here.
    sys.modules[name] = module
    spec.loader.exec_module(module)
    config = getattr(module, "config", None)
    if not isinstance(config, PatchConfig):
        raise PatchgenError(
            f"{display_path(path)}: a patch config module must define `config = PatchConfig(source_module=...)`"
        )
    return config


def generate_file(path: Path) -> Generated:
    return generate(load_config(path), path)


def write(generated: Generated) -> None:
    generated.py_path.parent.mkdir(parents=True, exist_ok=True)
    generated.py_path.write_text(generated.py_text, encoding="utf-8")
    generated.diff_path.write_text(generated.diff_text, encoding="utf-8")


@dataclass(frozen=True)
class Drift:
    path: Path
    detail: str  # the first differing lines (checked-in -> regenerated)


def find_drift(generated: Generated, max_lines: int = 12) -> list[Drift]:
    """Checked-in outputs that differ from what the config generates now."""
    drift = []
    for path, want in ((generated.py_path, generated.py_text), (generated.diff_path, generated.diff_text)):
        if not path.exists():
            drift.append(Drift(path, "  (missing: never generated)"))
            continue
        have = path.read_text(encoding="utf-8")
        if have == want:
            continue
        lines = list(
            difflib.unified_diff(have.splitlines(), want.splitlines(), "checked-in", "regenerated", n=1, lineterm="")
        )
        shown = "\n".join("  " + line for line in lines[2 : 2 + max_lines])
        more = "\n  ..." if len(lines) > 2 + max_lines else ""
        drift.append(Drift(path, shown + more))
    return drift
