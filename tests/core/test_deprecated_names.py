"""Renamed public names keep working under their old names, with a DeprecationWarning that
names the replacement (CHANGELOG.md, "Deprecated"); unknown names still raise AttributeError."""

import importlib
import warnings

import pytest

RENAMED = [
    ("kvgroups_core", "UnsupportedConfig", "UnsupportedConfigError"),
    ("kvgroups_core", "BackendNotFound", "BackendNotFoundError"),
    ("kvgroups_core", "CompileForbidden", "CompileForbiddenError"),
    ("kvgroups_core.errors", "UnsupportedConfig", "UnsupportedConfigError"),
    ("kvgroups_core.errors", "BackendNotFound", "BackendNotFoundError"),
    ("kvgroups_core.errors", "CompileForbidden", "CompileForbiddenError"),
    ("kvgroups_jax", "InPlaceWriteLost", "InPlaceWriteLostError"),
    ("kvgroups_jax.foreign", "InPlaceWriteLost", "InPlaceWriteLostError"),
    ("kvgroups_transport", "TransportUnavailable", "TransportUnavailableError"),
    ("kvgroups_transport", "PeerUnavailable", "PeerUnavailableError"),
    ("kvgroups_transport", "TransferTimeout", "TransferTimeoutError"),
    ("kvgroups_transport", "PublicationReleased", "PublicationReleasedError"),
    ("kvgroups_transport", "FingerprintMismatch", "FingerprintMismatchError"),
    ("kvgroups_transport.errors", "PeerUnavailable", "PeerUnavailableError"),
    ("kvgroups_conformance.compare", "check_blocks", "assert_blocks_match"),
    ("kvgroups_conformance.compare", "check_objects", "assert_objects_match"),
]


def _module(name):
    if name.startswith("kvgroups_jax"):
        pytest.importorskip("jax")
    return importlib.import_module(name)


@pytest.mark.parametrize("module, old, new", RENAMED)
def test_an_old_name_is_the_new_object_and_warns(module, old, new):
    mod = _module(module)
    with pytest.warns(DeprecationWarning, match=f"{old} is deprecated: use {new}"):
        found = getattr(mod, old)
    assert found is getattr(mod, new)
    assert callable(found)


@pytest.mark.parametrize("module", sorted({m for m, _, _ in RENAMED}))
def test_new_names_do_not_warn_and_unknown_names_still_fail(module):
    mod = _module(module)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for m, _, new in RENAMED:
            if m == module:
                getattr(mod, new)
    with pytest.raises(AttributeError, match="no attribute 'NoSuchName'"):
        mod.NoSuchName  # noqa: B018


def test_every_error_class_of_the_library_ends_in_error():
    import kvgroups_transport.errors as transport

    import kvgroups_core.errors as core

    classes = [
        c
        for mod in (core, transport)
        for c in vars(mod).values()
        if isinstance(c, type) and issubclass(c, Exception) and c.__module__ == mod.__name__
    ]
    assert len(classes) >= 10
    assert [c.__name__ for c in classes if not c.__name__.endswith("Error")] == []


def test_the_old_plane_field_name_reads_the_tensor_index_with_a_warning():
    from kvgroups_core import PlaneRef

    plane = PlaneRef(tensor_index=3, byte_offset=128)
    with pytest.warns(DeprecationWarning, match="tensor_slot is deprecated: use .*tensor_index"):
        assert plane.tensor_slot == 3
    with pytest.raises(AttributeError):
        plane.tensor_slot = 4  # read-only: the field is tensor_index
    with pytest.raises(TypeError):
        PlaneRef(tensor_slot=3, byte_offset=0)  # the constructor takes the new name only
