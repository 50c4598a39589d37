"""Whether torch sees a CUDA GPU, and the marks of tests that need one.

A module of its own rather than ``conftest``: test modules import these names, and the name
``conftest`` resolves to whichever test folder's conftest was imported first when several
folders are collected in one run.
"""

import pytest

torch = pytest.importorskip("torch")

HAS_CUDA = torch.cuda.is_available()
needs_cuda = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="no CUDA GPU")]
