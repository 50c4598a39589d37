import pytest

from .harnesses import harness_params, make_harness


@pytest.fixture(params=harness_params())
def harness(request):
    return make_harness(request.param)
