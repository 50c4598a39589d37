"""What pip installs: one version, declared once; CUDA wheels only where asked for; a
changelog entry for the version, with every deprecated name 0.1.0 ships."""

import importlib.metadata
import importlib.util
import tomllib
from pathlib import Path

import pytest

import kvgroups_core
from kvgroups_core.grouping import identity as grouping

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
CUDA_WHEELS = ("cuda-core", "cuda-bindings", "nvidia-cuda-nvrtc")


def test_the_version_has_one_source():
    project = PYPROJECT["project"]
    assert "version" not in project and "version" in project["dynamic"]
    attr = PYPROJECT["tool"]["setuptools"]["dynamic"]["version"]["attr"]
    assert attr == "kvgroups_core.__version__"
    # setuptools reads the literal without importing the package.
    assert (
        f'__version__ = "{kvgroups_core.__version__}"'
        in (ROOT / "kvgroups_core" / "__init__.py").read_text()
    )


def test_the_installed_metadata_and_the_backends_say_the_same_version():
    try:
        assert importlib.metadata.version("kvgroups") == kvgroups_core.__version__
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("kvgroups is not installed (run from a checkout)")
    if importlib.util.find_spec("torch") is not None:
        import kvgroups_torch

        assert kvgroups_torch.__version__ == kvgroups_core.__version__


def test_cuda_wheels_come_only_with_the_cuda_extra():
    extras = PYPROJECT["project"]["optional-dependencies"]
    for name, requirements in extras.items():
        pulled = [r for r in requirements if r.startswith(CUDA_WHEELS)]
        assert (name == "cuda") == bool(pulled), (name, pulled)
    assert all(any(r.startswith(w) for r in extras["cuda"]) for w in CUDA_WHEELS)
    # The runtimes whose APIs move between minor versions carry an upper bound.
    for name, package in (("jax", "jax"), ("vllm", "vllm")):
        (req,) = [r for r in extras[name] if r.startswith(package)]
        assert "<" in req, req


def test_the_changelog_has_this_version_and_every_deprecated_alias():
    text = (ROOT / "CHANGELOG.md").read_text()
    assert "## Unreleased" in text
    assert f"## {kvgroups_core.__version__} - " in text
    deprecated = text[text.index("### Deprecated") :]
    for old, (new, _obj) in grouping.DEPRECATED_ALIASES.items():
        assert f"`kvgroups_core.{old}`" in deprecated or f"`{old}`" in deprecated, old
        assert f"`{new}`" in deprecated, new
    for name in ("kv_layer_groups", "num_groups", "get_slots_per_chunk"):
        assert f"KVLayerGroupsManager.{name}`" in deprecated, name


def test_a_missing_cuda_package_names_the_extra_that_installs_it():
    nvrtc = pytest.importorskip("kvgroups_cuda.nvrtc")
    from kvgroups_core.errors import KernelCompileError

    with pytest.raises(KernelCompileError, match=r"cuda extra.*\.\[torch,cuda\]"):
        nvrtc.cuda_python("kvgroups_no_such_cuda_module")
