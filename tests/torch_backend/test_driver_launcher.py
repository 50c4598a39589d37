"""``driver.Launcher`` without a GPU: a fake driver library records the calls, so the context
handling (launch in PyTorch's primary context, switch and restore when another is current),
the programmatic launch (``cuLaunchKernelEx`` with programmatic stream serialization, only
where allowed) and the typed errors are checked on any machine."""

import ctypes

import pytest
from kvgroups_torch.cuda import driver

PRIMARY, OTHER = 0x1000, 0x2000


class FakeLib:
    def __init__(self, current, launch_code=0, major=9, driver_version=13000):
        self.current, self.launch_code, self.calls, self.major = current, launch_code, [], major
        self.driver_version = driver_version

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

    def cuLaunchKernelEx(self, config_address, function, params, extra):
        c = driver._LaunchConfig.from_address(config_address)
        attrs = [
            driver._LaunchAttribute.from_address(
                c.attrs + k * ctypes.sizeof(driver._LaunchAttribute)
            )
            for k in range(c.num_attrs)
        ]
        self.calls.append(
            (
                "launch_ex",
                function,
                (c.grid_x, c.grid_y, c.grid_z),
                (c.block_x, c.block_y, c.block_z),
                c.shared_bytes,
                c.stream or 0,
                [(a.id, a.value) for a in attrs],
                self.current,
            )
        )
        return self.launch_code

    def cuDriverGetVersion(self, ref):
        ref._obj.value = self.driver_version
        return 0

    def cuDeviceGet(self, ref, index):
        ref._obj.value = index
        return 0

    def cuDeviceGetAttribute(self, ref, attribute, device):
        assert attribute == 75  # CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR
        ref._obj.value = self.major
        return 0

    def cuGetErrorName(self, code, ref):
        return 0

    def cuGetErrorString(self, code, ref):
        return 0


@pytest.fixture
def fake(monkeypatch):
    def make(current, launch_code=0, programmatic=False, major=9, driver_version=13000):
        lib = FakeLib(current, launch_code, major, driver_version)
        monkeypatch.setattr(driver, "libcuda", lambda: lib)
        monkeypatch.setattr(driver, "primary_context", lambda index: PRIMARY)
        driver.programmatic_launch.cache_clear()
        return lib, driver.Launcher(0, 0xABC0, programmatic=programmatic)

    yield make
    driver.programmatic_launch.cache_clear()


def test_launch_in_the_current_primary_context_does_not_switch(fake):
    lib, launcher = fake(PRIMARY)
    launcher.launch(7, (3, 1, 1), 256, 99)
    launcher.launch(8, (4, 1, 1), 256, 99)
    # A launch without attributes: cuLaunchKernelEx all the same (its geometry is a struct,
    # cheaper to pass from Python than cuLaunchKernel's eleven scalars).
    assert lib.calls == [
        ("launch_ex", 7, (3, 1, 1), (256, 1, 1), 0, 99, [], PRIMARY),
        ("launch_ex", 8, (4, 1, 1), (256, 1, 1), 0, 99, [], PRIMARY),
    ]


@pytest.mark.parametrize("current", [OTHER, None])
def test_another_or_no_current_context_is_switched_for_the_launch_and_restored(fake, current):
    lib, launcher = fake(current)
    launcher.launch(7, (3, 1, 1), 128, 5)
    assert lib.calls == [
        ("set", PRIMARY),
        ("launch_ex", 7, (3, 1, 1), (128, 1, 1), 0, 5, [], PRIMARY),
        ("set", current),
    ]


@pytest.mark.parametrize("current", [PRIMARY, OTHER])
def test_a_refused_launch_raises_a_typed_error_and_restores_the_context(fake, current):
    lib, launcher = fake(current, launch_code=700)
    with pytest.raises(
        driver.KernelLaunchError, match=r"cuLaunchKernelEx: expected CUDA_SUCCESS, got .*700"
    ):
        launcher.launch(7, (1, 1, 1), 256, 0)
    assert lib.current == current


@pytest.mark.parametrize("current", [PRIMARY, OTHER])
def test_a_driver_without_launch_ex_takes_cu_launch_kernel(fake, monkeypatch, current):
    monkeypatch.delattr(FakeLib, "cuLaunchKernelEx")
    lib, launcher = fake(current)
    launcher.launch(7, (3, 1, 1), 128, 5)
    launcher.launch(8, (4, 2, 1), 64, 6)
    launches = [c for c in lib.calls if c[0] == "launch"]
    assert launches == [
        ("launch", 7, (3, 1, 1), 128, 5, PRIMARY),
        ("launch", 8, (4, 2, 1), 64, 6, PRIMARY),
    ]
    assert lib.current == current
    lib.launch_code = 700
    with pytest.raises(
        driver.KernelLaunchError, match=r"cuLaunchKernel: expected CUDA_SUCCESS, got .*700"
    ):
        launcher.launch(7, (1, 1, 1), 256, 0)


def test_a_programmatic_launch_allows_early_setup_with_the_same_grid_and_stream(fake):
    lib, launcher = fake(PRIMARY, programmatic=True)
    assert launcher.programmatic
    launcher.launch(7, (3, 2, 1), 256, 99)
    launcher.launch(8, (5, 1, 1), 128, 0)
    serialization = [(6, 1)]  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, allowed
    assert lib.calls == [
        ("launch_ex", 7, (3, 2, 1), (256, 1, 1), 0, 99, serialization, PRIMARY),
        ("launch_ex", 8, (5, 1, 1), (128, 1, 1), 0, 0, serialization, PRIMARY),
    ]


def test_a_repeated_launch_shape_keeps_the_config_and_a_new_one_rewrites_it(fake):
    lib, launcher = fake(PRIMARY, programmatic=True)
    shapes = [
        ((3, 1, 1), 256, 99),
        ((3, 1, 1), 256, 99),
        ((3, 1, 1), 256, 7),
        ((4, 1, 1), 256, 7),
        ((4, 1, 1), 128, 7),
        ((3, 1, 1), 256, 99),
    ]
    for function, (grid, threads, stream) in enumerate(shapes):
        launcher.launch(function, grid, threads, stream)
    assert [(c[1], c[2], c[3][0], c[5]) for c in lib.calls] == [
        (f, grid, threads, stream) for f, (grid, threads, stream) in enumerate(shapes)
    ]


@pytest.mark.parametrize("current", [OTHER, None])
def test_a_programmatic_launch_switches_and_restores_the_context_too(fake, current):
    lib, launcher = fake(current, programmatic=True)
    launcher.launch(7, (1, 1, 1), 256, 5)
    assert [c[0] for c in lib.calls] == ["set", "launch_ex", "set"]
    assert lib.calls[1][-1] == PRIMARY and lib.current == current


def _plain(call) -> bool:
    """A launch without programmatic stream serialization."""
    return call[0] == "launch" or (call[0] == "launch_ex" and call[6] == [])


def test_kernels_that_do_not_wait_and_older_gpus_keep_the_plain_launch(fake):
    lib, launcher = fake(PRIMARY, programmatic=False)
    launcher.launch(7, (1, 1, 1), 256, 5)
    lib2, older = fake(PRIMARY, programmatic=True, major=8)
    older.launch(7, (1, 1, 1), 256, 5)
    assert not launcher.programmatic and not older.programmatic
    assert _plain(lib.calls[0]) and _plain(lib2.calls[0])


def test_drivers_older_than_12_3_keep_the_plain_launch(fake):
    # 12.2 has cuLaunchKernelEx but cannot capture programmatic launches in a CUDA graph.
    lib, launcher = fake(PRIMARY, programmatic=True, driver_version=12020)
    launcher.launch(7, (1, 1, 1), 256, 5)
    assert not launcher.programmatic and _plain(lib.calls[0])
    lib, launcher = fake(PRIMARY, programmatic=True, driver_version=12030)
    assert launcher.programmatic


def test_the_environment_switch_turns_programmatic_launches_off(fake, monkeypatch):
    monkeypatch.setenv("KVGROUPS_PROGRAMMATIC_LAUNCH", "0")
    lib, launcher = fake(PRIMARY, programmatic=True)
    launcher.launch(7, (1, 1, 1), 256, 5)
    assert not launcher.programmatic and _plain(lib.calls[0])


def test_a_driver_without_launch_ex_keeps_the_plain_launch(fake, monkeypatch):
    monkeypatch.delattr(FakeLib, "cuLaunchKernelEx")
    lib, launcher = fake(PRIMARY, programmatic=True)
    launcher.launch(7, (1, 1, 1), 256, 5)
    assert not launcher.programmatic and lib.calls[0][0] == "launch"


def test_a_refused_programmatic_launch_names_the_call(fake):
    lib, launcher = fake(PRIMARY, launch_code=700, programmatic=True)
    with pytest.raises(
        driver.KernelLaunchError, match=r"cuLaunchKernelEx: expected CUDA_SUCCESS, got .*700"
    ):
        launcher.launch(7, (1, 1, 1), 256, 0)
