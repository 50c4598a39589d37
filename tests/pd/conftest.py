import importlib.util
import sys
from pathlib import Path

# The P/D tests reuse the tensor-parallel tests' models (tests/tp/tp_models.py); backends/ is
# on the path through the editable install, a fresh checkout without it still finds them.
_TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(_TESTS / "tp"))
if importlib.util.find_spec("kvgroups_transport") is None:
    sys.path.insert(0, str(_TESTS.parent / "backends"))
