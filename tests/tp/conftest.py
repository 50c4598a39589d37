import importlib.util
import sys
from pathlib import Path

# backends/ is on the path through the editable install; a fresh checkout without it still
# finds kvgroups_torch.
if importlib.util.find_spec("kvgroups_torch") is None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "backends"))
