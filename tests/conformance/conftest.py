import pytest

pytest.register_assert_rewrite("kvgroups_conformance")

from .harnesses import harness_params, make_harness, pair_params  # noqa: E402


@pytest.fixture(params=harness_params())
def harness(request):
    return make_harness(request.param)


@pytest.fixture
def harness_pair(request):
    a, b = request.param
    return make_harness(a), make_harness(b)


@pytest.hookimpl(trylast=True)
def pytest_generate_tests(metafunc):
    # Parametrised last, so a pair's id follows the case's own parameters (as it always has).
    if "harness_pair" in metafunc.fixturenames:
        metafunc.parametrize("harness_pair", pair_params(), indirect=True)
