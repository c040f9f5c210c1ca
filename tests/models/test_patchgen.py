"""The patchgen generator on small synthetic upstream modules: each verb, name_map, text preservation, errors."""

# Replacement bodies below use names of the synthetic upstream module (scale, ToyLayer, ...), which is
# where the generated code runs; they are undefined here by design.
# ruff: noqa: F821

from __future__ import annotations

import importlib.util
import re
import uuid

import pytest

from spindle.patchgen import PatchConfig, PatchgenError
from spindle.patchgen.check import load_config
from spindle.patchgen.generator import MARKER, generate, read_upstream

UTILS = """\
def decorate(fn):
    fn.decorated = True
    return fn


def helper(x):
    return x
"""

CONFIGURATION = """\
class ToyConfig:
    def __init__(self, n=2):
        self.n = n
"""

MODELING = '''\
# Upstream header comment: must survive byte for byte.
import math

from ...utils import decorate, helper  # a trailing comment
from .configuration_toy import ToyConfig


def scale(x, factor=2):
    # upstream comment inside a function
    return x * factor


@decorate
def shift(x, by=1):
    return x + by


class ToyLayer:
    def __init__(self, config: ToyConfig, idx: int):
        self.config = config
        self.idx = idx  # keep me

    def forward(self, x, *, mask=None):
        return scale(x) + self.idx


@decorate
class ToyModel:
    """Upstream docstring."""

    def __init__(self, config):
        self.layers = [ToyLayer(config, i) for i in range(config.n)]

    @decorate
    def forward(self, x):
        for layer in self.layers:
            x = layer.forward(x)
        return x

    @decorate
    def generate(self, x, *args, steps=1, **kwargs):
        """Upstream docstring of generate."""
        # upstream comment inside generate
        return [self.forward(x)] * steps

    def config_class(self):
        from .configuration_toy import ToyConfig as C  # a nested relative import

        return C


class ToyOutput:
    value: int = 0


class ToyCache:
    def __init__(self, size=0):
        if not size:
            return
        self.size = size
'''

# Shared functions a delegate_method patch calls (importable, like spindle/models/shared/).
DELEGATES = """\
def generate_via(model, x, *args, **inputs):
    return ("generate_via", type(model).__name__, x, args, inputs)


def forward_via(model, x, **inputs):
    return ("forward_via", type(model).__name__, x, inputs)


def takes_only_x(model, x):
    return x
"""

# The MoE sibling: same layout with other names, and a forward that grew a parameter.
MODELING_MOE = (
    MODELING.replace("configuration_toy", "configuration_toymoe")
    .replace("Toy", "ToyMoe")
    .replace("def forward(self, x):", "def forward(self, x, router=None):")
)


@pytest.fixture(scope="module")
def pkg(tmp_path_factory):
    """A throwaway package `<pkg>.models.toy[moe]` laid out like transformers, importable from a tmp dir."""
    root = tmp_path_factory.mktemp("src")
    name = f"toypkg_{uuid.uuid4().hex[:8]}"
    files = {
        "__init__.py": "",
        "utils.py": UTILS,
        "delegates.py": DELEGATES,
        "models/__init__.py": "",
        "models/toy/__init__.py": "",
        "models/toy/configuration_toy.py": CONFIGURATION,
        "models/toy/modeling_toy.py": MODELING,
        "models/toymoe/__init__.py": "",
        "models/toymoe/configuration_toymoe.py": CONFIGURATION.replace("Toy", "ToyMoe"),
        "models/toymoe/modeling_toymoe.py": MODELING_MOE,
    }
    for rel, text in files.items():
        path = root / name / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(root))
        yield name


def _config(pkg, model="toy", **kwargs):
    return PatchConfig(source_module=f"{pkg}.models.{model}.modeling_{model}", **kwargs)


def _generate(config, tmp_path):
    family = tmp_path / "fam"  # a package folder, like spindle/models/<family>/
    family.mkdir(exist_ok=True)
    (family / "__init__.py").touch()
    return generate(config, family / "patches.py")


def _import(generated, tmp_path):
    path = tmp_path / f"gen_{uuid.uuid4().hex[:8]}.py"
    path.write_text(generated.py_text)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _body(text):
    """The generated text without its header (everything before the first upstream line)."""
    return text[text.index("# Upstream header comment") :]


def _upstream_abs(pkg, model="toy"):
    return read_upstream(f"{pkg}.models.{model}.modeling_{model}").text


# -- the verbs


def test_override_method_keeps_everything_else_byte_identical(pkg, tmp_path):
    config = _config(pkg)

    @config.override_method("ToyModel.forward", description="double the output")
    def forward(self, x):
        # patched comment
        for layer in self.layers:
            x = layer.forward(x)
        return 2 * x

    gen = _generate(config, tmp_path)
    body, upstream = _body(gen.py_text), _upstream_abs(pkg)
    head, _, tail = upstream.partition("    @decorate\n    def forward(self, x):")
    assert body.startswith(head)  # everything above the method, comments included
    assert body.endswith(tail[tail.index("\n    def config_class") :])  # and everything below it
    assert f"    {MARKER} override_method ToyModel.forward: double the output\n    @decorate\n    def forward" in body
    assert "# patched comment" in body and "def forward(self, x):" in body
    module = _import(gen, tmp_path)
    model = module.ToyModel(module.ToyConfig(n=2))
    assert model.forward(3) == 2 * ((3 * 2 + 0) * 2 + 1)
    assert module.ToyModel.forward.decorated  # the upstream decorator stays on the method


def test_relative_imports_become_absolute_everywhere(pkg, tmp_path):
    gen = _generate(_config(pkg), tmp_path)
    assert f"from {pkg}.utils import decorate, helper  # a trailing comment\n" in gen.py_text
    assert f"from {pkg}.models.toy.configuration_toy import ToyConfig\n" in gen.py_text
    assert f"from {pkg}.models.toy.configuration_toy import ToyConfig as C  # a nested" in gen.py_text
    assert not re.search(r"^\s*from \.", gen.py_text, re.M)
    # With no patches the body is upstream with absolute imports, and the diff is only the header.
    assert _body(gen.py_text) == _upstream_abs(pkg)
    assert gen.diff_text.count("\n@@ ") == 1


def test_replace_class_renames_and_keeps_only_its_own_decorators(pkg, tmp_path):
    config = _config(pkg)

    @config.replace_class("ToyLayer", description="a layer that adds 100")
    class PatchedLayer:
        # comment in the replacement
        def __init__(self, config, idx):
            self.idx = idx

        def forward(self, x, *, mask=None):
            return x + 100

    gen = _generate(config, tmp_path)
    assert f"{MARKER} replace_class ToyLayer: a layer that adds 100\nclass ToyLayer:\n" in gen.py_text
    assert "PatchedLayer" not in gen.py_text and "# comment in the replacement" in gen.py_text
    assert "self.idx = idx  # keep me" not in gen.py_text
    module = _import(gen, tmp_path)
    assert module.ToyModel(module.ToyConfig(n=2)).forward(1) == 201


def test_replace_function_keeps_upstream_decorators(pkg, tmp_path):
    config = _config(pkg)

    @config.replace_function("shift", description="shift twice")
    def shift(x, by=1):
        return x + 2 * by

    module = _import(_generate(config, tmp_path), tmp_path)
    assert module.shift(1) == 3 and module.shift.decorated


def test_modify_init_appends_after_the_upstream_body(pkg, tmp_path):
    config = _config(pkg)

    @config.modify_init("ToyLayer", description="remember the square")
    def layer_init(self, config, idx):
        """Docstrings of the wrapper are not copied."""
        self.square = idx * idx

    gen = _generate(config, tmp_path)
    assert "Docstrings of the wrapper" not in gen.py_text
    assert (
        "        self.idx = idx  # keep me\n"
        f"        {MARKER} modify_init ToyLayer: remember the square (appended)\n"
        "        self.square = idx * idx\n"
    ) in gen.py_text
    assert (
        f"    {MARKER} modify_init ToyLayer: remember the square\n    def __init__(self, config: ToyConfig"
        in gen.py_text
    )
    module = _import(gen, tmp_path)
    layer = module.ToyLayer(module.ToyConfig(), 3)
    assert (layer.idx, layer.square) == (3, 9)


def test_imports_helpers_blocks_and_dropped_names(pkg, tmp_path):
    config = _config(pkg)
    config.add_import("os.path", names=["join"])
    config.add_import("json", alias="_json")
    config.add_post_import_block(
        """
        try:
            import tomllib as TOML
        except ImportError:
            TOML = None
        """,
        description="optional toml",
    )

    @config.add_helper
    def triple(x):
        return 3 * x

    config.drop_import_names("helper", "math")

    @config.override_method("ToyLayer.forward")
    def forward(self, x, *, mask=None):
        return triple(x) + len(join("a", "b")) + len(_json.dumps(TOML is not None))

    gen = _generate(config, tmp_path)
    text = gen.py_text
    assert "import math\n" not in text and f"from {pkg}.utils import decorate\n" in text
    assert f"{MARKER} drop_import_names math\n" in text and f"{MARKER} drop_import_names helper\n" in text
    assert (
        f"{MARKER} add_import: names used by the patched code\nfrom os.path import join\nimport json as _json\n" in text
    )
    assert f"{MARKER} add_post_import_block module: optional toml\ntry:\n" in text
    assert f"{MARKER} add_helper triple\ndef triple(x):" in text
    # Added code goes after upstream's last import, before its first definition.
    assert text.index("from os.path import join") > text.index("import ToyConfig\n") > 0
    assert text.index("def triple") < text.index("def scale")
    module = _import(gen, tmp_path)
    assert module.ToyLayer(module.ToyConfig(), 0).forward(2) == 6 + 3 + len("true")
    assert not hasattr(module, "math") and not hasattr(module, "helper")


def _dense_layer_forward(self, x, *, mask=None):
    # ToyLayer stays in this comment
    return ToyLayer.__name__ + ":" + str(x) + "ToyLayer"


def test_name_map_reuses_a_patch_for_a_sibling_model(pkg, tmp_path):
    config = _config(pkg, "toymoe")
    config.override_method(
        "ToyMoeLayer.forward", replacement=_dense_layer_forward, name_map={"Toy": "ToyMoe"}, description="shared"
    )
    gen = _generate(config, tmp_path)
    assert "return ToyMoeLayer.__name__" in gen.py_text  # identifiers renamed
    assert '"ToyLayer"' in gen.py_text and "# ToyLayer stays in this comment" in gen.py_text  # text untouched
    module = _import(gen, tmp_path)
    assert module.ToyMoeLayer(module.ToyMoeConfig(), 0).forward(1) == "ToyMoeLayer:1ToyLayer"


def test_extend_maps_every_patch_of_a_sibling_config(pkg, tmp_path):
    dense = _config(pkg)
    dense.add_import("os.path", names=["join"])
    dense.override_method("ToyLayer.forward", replacement=_dense_layer_forward, description="shared")
    sibling = _config(pkg, "toymoe")
    sibling.extend(dense, name_map={"Toy": "ToyMoe"})
    assert [(p.kind, p.target) for p in sibling.patches] == [
        ("add_import", "os.path"),
        ("override_method", "ToyMoeLayer.forward"),
    ]
    module = _import(_generate(sibling, tmp_path), tmp_path)
    assert module.ToyMoeLayer(module.ToyMoeConfig(), 0).forward(2) == "ToyMoeLayer:2ToyLayer"
    assert dense.patches[1].target == "ToyLayer.forward"  # the source config is unchanged


def _delegates(pkg):
    return importlib.import_module(f"{pkg}.delegates")


def _flat(text):
    """`text` with its whitespace runs folded, so a check does not depend on how ruff wrapped a call."""
    return " ".join(text.split())


def test_delegate_method_keeps_upstream_signature_decorators_and_docstring(pkg, tmp_path):
    config = _config(pkg)
    config.delegate_method("ToyModel.generate", to=_delegates(pkg).generate_via, description="shared generate")
    gen = _generate(config, tmp_path)
    text = _flat(gen.py_text)
    assert (
        f"{MARKER} delegate_method ToyModel.generate: shared generate @decorate "
        'def generate(self, x, *args, steps=1, **kwargs): """Upstream docstring of generate.""" '
        "return generate_via( self, x, *args, steps=steps, **kwargs, )"  # positional before *args, the rest by name
    ) in text
    assert "upstream comment inside generate" not in text  # the body is gone, not only its statements
    assert f"{MARKER} add_import: names used by the patched code from {pkg}.delegates import generate_via" in text
    removed = [line for line in gen.diff_text.splitlines() if line.startswith("-") and not line.startswith("---")]
    assert removed == ["-        # upstream comment inside generate", "-        return [self.forward(x)] * steps"]
    module = _import(gen, tmp_path)
    model = module.ToyModel(module.ToyConfig())
    assert model.generate(3, 4, steps=2, extra=5) == ("generate_via", "ToyModel", 3, (4,), {"steps": 2, "extra": 5})
    assert module.ToyModel.generate.decorated


def test_delegate_method_without_docstring_passes_keyword_parameters_by_name(pkg, tmp_path):
    config = _config(pkg)
    config.delegate_method("ToyLayer.forward", to=_delegates(pkg).forward_via)
    config.delegate_method("ToyModel.generate", to=_delegates(pkg).generate_via)
    gen = _generate(config, tmp_path)
    assert "def forward(self, x, *, mask=None): return forward_via( self, x=x, mask=mask, )" in _flat(gen.py_text)
    assert gen.py_text.count(f"from {pkg}.delegates import") == 2  # one import per delegate
    module = _import(gen, tmp_path)
    assert module.ToyLayer(module.ToyConfig(), 0).forward(7, mask=1) == ("forward_via", "ToyLayer", 7, {"mask": 1})


def test_extend_retargets_a_delegate_and_imports_it_once(pkg, tmp_path):
    dense = _config(pkg)
    dense.delegate_method("ToyLayer.forward", to=_delegates(pkg).forward_via)
    sibling = _config(pkg, "toymoe")
    sibling.extend(dense, name_map={"Toy": "ToyMoe"})
    sibling.delegate_method("ToyMoeModel.forward", to=_delegates(pkg).forward_via)
    gen = _generate(sibling, tmp_path)
    assert gen.py_text.count(f"from {pkg}.delegates import forward_via\n") == 1
    module = _import(gen, tmp_path)
    assert module.ToyMoeLayer(module.ToyMoeConfig(), 0).forward(1) == ("forward_via", "ToyMoeLayer", 1, {"mask": None})
    # The sibling's own forward grew `router`: the shared function takes it in **inputs, by name.
    assert module.ToyMoeModel(module.ToyMoeConfig()).forward(2, router=3) == (
        "forward_via",
        "ToyMoeModel",
        2,
        {"router": 3},
    )


def _local_config_delegate(model, x, **inputs):
    return x


def test_delegate_method_errors_name_the_patch_and_the_fix(pkg, tmp_path):
    config = _config(pkg)
    config.delegate_method("ToyLayer.forward", to=_delegates(pkg).takes_only_x)
    with pytest.raises(PatchgenError) as err:
        _generate(config, tmp_path)
    message = str(err.value)
    assert "patch delegate_method 'ToyLayer.forward' (tests/models/test_patchgen.py:" in message
    assert f"{pkg}.delegates.takes_only_x cannot take upstream's parameters (self, x, mask" in message

    config = _config(pkg)
    config.delegate_method("ToyLayer.fwd", to=_delegates(pkg).forward_via)
    with pytest.raises(
        PatchgenError, match=r"method of class 'ToyLayer': 'fwd' not found.*close names upstream: forward"
    ):
        _generate(config, tmp_path)

    def nested(model, **inputs):
        return None

    with pytest.raises(PatchgenError, match="`to` must be a module-level function of an importable module"):
        _config(pkg).delegate_method("ToyLayer.forward", to=nested)
    with pytest.raises(PatchgenError, match=r"'Class\.method'"):
        _config(pkg).delegate_method("forward", to=_delegates(pkg).forward_via)
    # A function of the config file itself: generated code cannot import it.
    patches = tmp_path / "fam" / "patches.py"
    patches.parent.mkdir(exist_ok=True)
    patches.write_text(
        "from spindle.patchgen import PatchConfig\n\n"
        f"config = PatchConfig(source_module='{pkg}.models.toy.modeling_toy')\n\n\n"
        "def forward(model, **inputs):\n    return None\n\n\n"
        "config.delegate_method('ToyLayer.forward', to=forward)\n"
    )
    with pytest.raises(PatchgenError, match=r"forward is defined in the patch config.*use override_method"):
        load_config(patches)


def test_header_names_source_version_config_and_every_patch(pkg, tmp_path):
    config = _config(pkg)
    config.add_import("os")

    @config.replace_function("scale", description="triple instead")
    def scale(x, factor=2):
        return x * factor * 1.5

    gen = _generate(config, tmp_path)
    header = gen.py_text[: gen.py_text.index("# Upstream header comment")]
    assert "DO NOT EDIT BY HAND" in header
    assert f"source module:  {pkg}.models.toy.modeling_toy ({pkg}/models/toy/modeling_toy.py)" in header
    assert "source version: unknown" in header  # a package without distribution metadata
    assert "config:         fam/patches.py" in header
    assert "1. add_import os\n" in header and "2. replace_function scale - triple instead\n" in header
    assert gen.py_path == tmp_path / "fam" / "generated" / "patched_modeling_toy.py"
    assert gen.diff_path.name == "patched_modeling_toy.diff"


def test_header_names_the_transformers_version(tmp_path):
    import transformers

    config = PatchConfig(source_module="transformers.models.qwen3.modeling_qwen3")
    gen = generate(config, tmp_path / "patches.py")
    assert f"#   transformers:   {transformers.__version__}\n" in gen.py_text
    assert "from transformers.utils import TransformersKwargs" in gen.py_text


def test_diff_has_one_hunk_per_patch_and_only_patched_lines(pkg, tmp_path):
    config = _config(pkg)

    @config.override_method("ToyLayer.forward", description="plus one")
    def forward(self, x, *, mask=None):
        return scale(x) + self.idx + 1

    @config.replace_function("shift")
    def shift(x, by=1):
        return x - by

    diff = _generate(config, tmp_path).diff_text
    assert diff.count("\n@@ ") == 3  # header, shift, ToyLayer.forward
    removed = [line for line in diff.splitlines() if line.startswith("-") and not line.startswith("---")]
    assert removed == ["-    return x + by", "-        return scale(x) + self.idx"]
    assert f"--- a/{pkg}/models/toy/modeling_toy.py" in diff
    assert "+++ b/fam/generated/patched_modeling_toy.py" in diff


def test_output_is_formatted_and_independent_of_the_repo_ruff_config(pkg, tmp_path, monkeypatch):
    config = _config(pkg)

    @config.replace_function("scale")
    def scale(x, factor=2):
        return x * factor  # fmt-able

    first = _generate(config, tmp_path).py_text
    assert "return x * factor  # fmt-able" in first
    project = tmp_path / "project"
    project.mkdir()
    (project / "pyproject.toml").write_text(
        '[tool.ruff]\nline-length = 40\n[tool.ruff.format]\nquote-style = "single"\n'
    )
    monkeypatch.chdir(project)
    assert _generate(config, tmp_path).py_text == first


# -- errors


def test_missing_targets_name_the_patch_the_target_and_the_source(pkg, tmp_path):
    cases = [
        ("override_method", "ToyModel.forwrd", "method of class 'ToyModel': 'forwrd'"),
        ("override_method", "ToyModl.forward", "class 'ToyModl'"),
        ("replace_class", "ToyBlock", "class 'ToyBlock'"),
        ("replace_function", "scaled", "module-level function 'scaled'"),
        ("modify_init", "ToyConfig", "class 'ToyConfig'"),  # imported upstream, not defined there
        ("modify_init", "ToyOutput", "method of class 'ToyOutput': '__init__'"),
    ]
    for kind, target, what in cases:
        config = _config(pkg)
        replacement = _PlaceholderLayer if kind == "replace_class" else _dense_layer_forward
        getattr(config, kind)(target, replacement=replacement)
        with pytest.raises(PatchgenError) as err:
            _generate(config, tmp_path)
        message = str(err.value)
        assert f"patch {kind} {target!r}" in message and "tests/models/test_patchgen.py" in message
        assert what in message and "not found in" in message and "modeling_toy.py" in message
    with pytest.raises(PatchgenError, match="close names upstream: forward"):
        config = _config(pkg)
        config.override_method("ToyModel.forwrd", replacement=_dense_layer_forward)
        _generate(config, tmp_path)


class _PlaceholderLayer:
    pass


def _dense_model_forward(self, x):
    return x


def test_signature_drift_is_reported_with_both_signatures(pkg, tmp_path):
    # The dense forward, reused on the MoE sibling, misses the sibling's `router` parameter.
    config = _config(pkg, "toymoe")
    config.override_method("ToyMoeModel.forward", replacement=_dense_model_forward, name_map={"Toy": "ToyMoe"})
    with pytest.raises(PatchgenError) as err:
        _generate(config, tmp_path)
    message = str(err.value)
    assert "override_method 'ToyMoeModel.forward'" in message and "no longer matches upstream" in message
    assert "upstream:    (self, x, router=None)" in message and "replacement: (self, x)" in message
    assert "modeling_toymoe.py" in message
    # Intended changes are allowed explicitly.
    config = _config(pkg, "toymoe")
    config.override_method(
        "ToyMoeModel.forward", replacement=_dense_model_forward, name_map={"Toy": "ToyMoe"}, allow_signature_change=True
    )
    assert "def forward(self, x):\n        return x" in _generate(config, tmp_path).py_text
    # Defaults count as part of the signature.
    config = _config(pkg)
    config.replace_function("scale", replacement=lambda_free_scale)
    with pytest.raises(PatchgenError, match=r"upstream:    \(x, factor=2\)"):
        _generate(config, tmp_path)


def lambda_free_scale(x, factor=3):
    return x * factor


def test_undefined_names_ask_for_an_import(pkg, tmp_path):
    config = _config(pkg)

    @config.replace_function("scale")
    def scale(x, factor=2):
        return not_imported_anywhere(x) * factor  # noqa: F821, RUF100 (a noqa must not hide it from patchgen)

    with pytest.raises(PatchgenError, match=r"Undefined name `not_imported_anywhere`.*add config.add_import"):
        _generate(config, tmp_path)


def test_conflicting_and_bad_patches_are_rejected(pkg, tmp_path):
    config = _config(pkg)
    config.replace_function("scale", replacement=_scale_copy)
    config.replace_function("scale", replacement=_scale_copy)
    with pytest.raises(PatchgenError, match="replace the same upstream definition"):
        _generate(config, tmp_path)

    config = _config(pkg)
    config.replace_class("ToyLayer", replacement=_PlaceholderLayer)
    config.override_method("ToyLayer.forward", replacement=_dense_layer_forward)
    with pytest.raises(PatchgenError, match="touch the same upstream lines"):
        _generate(config, tmp_path)

    config = _config(pkg)
    config.modify_init("ToyCache", replacement=_cache_init)
    with pytest.raises(PatchgenError, match=r"ToyCache.__init__ returns early \(.*modeling_toy.py:\d+\)"):
        _generate(config, tmp_path)

    config = _config(pkg)
    config.drop_import_names("not_imported")
    with pytest.raises(PatchgenError, match="imported name 'not_imported' not found"):
        _generate(config, tmp_path)

    with pytest.raises(PatchgenError, match="must be a class"):
        _config(pkg).replace_class("ToyLayer", replacement=_scale_copy)
    with pytest.raises(PatchgenError, match=r"'Class\.method'"):
        _config(pkg).override_method("forward", replacement=_scale_copy)
    with pytest.raises(PatchgenError, match="not a valid import"):
        _config(pkg).add_import("os", names=["1x"])
    with pytest.raises(PatchgenError, match="does not parse"):
        _config(pkg).add_post_import_block("def broken(:\n")
    with pytest.raises(PatchgenError, match="was not found"):
        _generate(PatchConfig(source_module=f"{pkg}.models.toy.modeling_gone"), tmp_path)


def _cache_init(self, size=0):
    self.extra = True


def _scale_copy(x, factor=2):
    return x * factor


def test_multiline_strings_in_replacements_are_not_reindented(pkg, tmp_path):
    config = _config(pkg)
    config.override_method("ToyLayer.forward", replacement=_layer_forward_with_string)
    module = _import(_generate(config, tmp_path), tmp_path)
    assert module.ToyLayer(module.ToyConfig(), 0).forward(0) == "a\n  b\nc"


def _layer_forward_with_string(self, x, *, mask=None):
    return """a
  b
c"""


def test_the_causal_lm_patch_extended_onto_qwen3_moe_is_the_moe_patch(tmp_path):
    # One shared forward serves the dense and the MoE heads, and upstream's signature tells them apart
    # (output_router_logits is passed on, so the router aux loss is added): reusing the dense config on
    # the MoE model through name_map generates the MoE family's own code, not a forward that drops it.
    from spindle.models.qwen3 import patches as qwen3
    from spindle.models.qwen3_moe import patches as qwen3_moe

    config = PatchConfig(source_module="transformers.models.qwen3_moe.modeling_qwen3_moe")
    config.extend(qwen3.config, name_map={"Qwen3": "Qwen3Moe"})

    def code(text):  # comments (the header, the markers' descriptions) differ
        return [line for line in text.splitlines() if not line.lstrip().startswith("#")]

    extended = generate(config, tmp_path / "patches.py").py_text
    assert "output_router_logits=output_router_logits," in extended
    assert code(extended) == code(generate(qwen3_moe.config, tmp_path / "patches.py").py_text)
