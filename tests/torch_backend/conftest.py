import pytest

pytest.importorskip("torch")


@pytest.fixture
def cubin_cache(tmp_path, monkeypatch):
    """An empty private cubin cache folder."""
    monkeypatch.setenv("KVGROUPS_CACHE_DIR", str(tmp_path / "cubins"))
    monkeypatch.delenv("KVGROUPS_NO_COMPILE", raising=False)
    return tmp_path / "cubins"
