"""``driver.Launcher`` without a GPU: a fake driver library records the calls, so the context
handling (launch in PyTorch's primary context, switch and restore when another is current)
and the typed errors are checked on any machine."""

import pytest
from kvgroups_torch import driver

PRIMARY, OTHER = 0x1000, 0x2000


class FakeLib:
    def __init__(self, current, launch_code=0):
        self.current, self.launch_code, self.calls = current, launch_code, []

    def cuCtxGetCurrent(self, ref):
        ref._obj.value = self.current
        return 0

    def cuCtxSetCurrent(self, ctx):
        self.calls.append(("set", ctx))
        self.current = ctx
        return 0

    def cuLaunchKernel(self, function, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        self.calls.append(("launch", function, (gx, gy, gz), bx, stream, self.current))
        return self.launch_code

    def cuGetErrorName(self, code, ref):
        return 0

    def cuGetErrorString(self, code, ref):
        return 0


@pytest.fixture
def fake(monkeypatch):
    def make(current, launch_code=0):
        lib = FakeLib(current, launch_code)
        monkeypatch.setattr(driver, "_libcuda", lambda: lib)
        monkeypatch.setattr(driver, "primary_context", lambda index: PRIMARY)
        return lib, driver.Launcher(0, 0xABC0)
    return make


def test_launch_in_the_current_primary_context_does_not_switch(fake):
    lib, launcher = fake(PRIMARY)
    launcher.launch(7, (3, 1, 1), 256, 99)
    launcher.launch(8, (4, 1, 1), 256, 99)
    assert lib.calls == [("launch", 7, (3, 1, 1), 256, 99, PRIMARY),
                         ("launch", 8, (4, 1, 1), 256, 99, PRIMARY)]


@pytest.mark.parametrize("current", [OTHER, None])
def test_another_or_no_current_context_is_switched_for_the_launch_and_restored(fake, current):
    lib, launcher = fake(current)
    launcher.launch(7, (3, 1, 1), 128, 5)
    assert lib.calls == [("set", PRIMARY), ("launch", 7, (3, 1, 1), 128, 5, PRIMARY),
                         ("set", current)]


@pytest.mark.parametrize("current", [PRIMARY, OTHER])
def test_a_refused_launch_raises_a_typed_error_and_restores_the_context(fake, current):
    lib, launcher = fake(current, launch_code=700)
    with pytest.raises(driver.KernelLaunchError, match=r"cuLaunchKernel: expected CUDA_SUCCESS, got .*700"):
        launcher.launch(7, (1, 1, 1), 256, 0)
    assert lib.current == current
