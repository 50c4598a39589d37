import importlib.util
import sys
from pathlib import Path

import pytest

# backends/ is on the path through the editable install; a fresh checkout without it still
# finds kvgroups_torch.
if importlib.util.find_spec("kvgroups_torch") is None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "backends"))

pytest.importorskip("torch")


@pytest.fixture
def cubin_cache(tmp_path, monkeypatch):
    """An empty private cubin cache folder."""
    monkeypatch.setenv("KVGROUPS_CACHE_DIR", str(tmp_path / "cubins"))
    monkeypatch.delenv("KVGROUPS_NO_COMPILE", raising=False)
    return tmp_path / "cubins"
