"""Stand-ins for SGLang's KV pools (sglang is not installed here): the attribute names and
buffer shapes of ``sglang/srt/mem_cache/memory_pool.py`` (MHATokenToKVPool,
MLATokenToKVPool, SWAKVPool, MambaPool) and ``pool_host`` (MambaPoolHost), nothing else.
Buffers hold random bytes."""

from __future__ import annotations

import torch


def _rand(shape, dtype, gen):
    out = torch.empty(shape, dtype=dtype)
    out.view(torch.uint8).copy_(
        torch.randint(0, 256, out.view(torch.uint8).shape, dtype=torch.uint8, generator=gen)
    )
    return out


class MHATokenToKVPool:
    def __init__(
        self, size, page_size, dtype, head_num, head_dim, layer_num, start_layer=0, seed=0
    ):
        self.size, self.page_size, self.dtype, self.store_dtype = size, page_size, dtype, dtype
        self.head_num, self.head_dim, self.layer_num = head_num, head_dim, layer_num
        self.start_layer, self.device = start_layer, "cpu"
        gen = torch.Generator().manual_seed(seed)
        # One extra page: slot 0's page is SGLang's padding page.
        self.k_buffer = [
            _rand((size + page_size, head_num, head_dim), dtype, gen) for _ in range(layer_num)
        ]
        self.v_buffer = [
            _rand((size + page_size, head_num, head_dim), dtype, gen) for _ in range(layer_num)
        ]


class MLATokenToKVPool:
    def __init__(
        self,
        size,
        page_size,
        dtype,
        kv_lora_rank,
        qk_rope_head_dim,
        layer_num,
        start_layer=0,
        seed=0,
    ):
        self.size, self.page_size, self.dtype, self.store_dtype = size, page_size, dtype, dtype
        self.kv_lora_rank, self.qk_rope_head_dim = kv_lora_rank, qk_rope_head_dim
        self.layer_num, self.start_layer, self.device = layer_num, start_layer, "cpu"
        gen = torch.Generator().manual_seed(seed)
        self.kv_buffer = [
            _rand((size + page_size, 1, kv_lora_rank + qk_rope_head_dim), dtype, gen)
            for _ in range(layer_num)
        ]


class SWAKVPool:
    def __init__(
        self,
        size,
        size_swa,
        page_size,
        dtype,
        head_num,
        head_dim,
        swa_attention_layer_ids,
        full_attention_layer_ids,
        seed=0,
    ):
        self.size, self.size_swa, self.page_size, self.dtype = size, size_swa, page_size, dtype
        self.swa_layer_nums = len(swa_attention_layer_ids)
        self.full_layer_nums = len(full_attention_layer_ids)
        self.full_kv_pool = MHATokenToKVPool(
            size, page_size, dtype, head_num, head_dim, self.full_layer_nums, seed=seed
        )
        self.swa_kv_pool = MHATokenToKVPool(
            size_swa, page_size, dtype, head_num, head_dim, self.swa_layer_nums, seed=seed + 1
        )
        self.layers_mapping = {}
        for i, g in enumerate(full_attention_layer_ids):
            self.layers_mapping[g] = (i, False)
        for i, g in enumerate(swa_attention_layer_ids):
            self.layers_mapping[g] = (i, True)


class _MambaState:
    def __init__(self, conv, temporal):
        self.conv, self.temporal = conv, temporal


class MambaPool:
    """``mamba_cache.conv`` (one ``[num_mamba_layers, size + 1, *conv_shape]`` per conv state)
    and ``mamba_cache.temporal`` ``[num_mamba_layers, size + 1, *temporal_shape]``."""

    def __init__(
        self,
        size,
        conv_shapes,
        temporal_shape,
        num_mamba_layers,
        conv_dtype=torch.bfloat16,
        temporal_dtype=torch.float32,
        seed=0,
    ):
        self.size, self.num_mamba_layers, self.device = size, num_mamba_layers, "cpu"
        gen = torch.Generator().manual_seed(seed)
        conv = [
            _rand((num_mamba_layers, size + 1) + tuple(s), conv_dtype, gen) for s in conv_shapes
        ]
        temporal = _rand((num_mamba_layers, size + 1) + tuple(temporal_shape), temporal_dtype, gen)
        self.mamba_cache = _MambaState(conv, temporal)


class MambaPoolHost:
    """``conv_buffer`` (a list) and ``temporal_buffer`` in ``layout``: ``layer_first``
    ``[num_mamba_layers, size, *shape]`` or ``page_first`` ``[size, num_mamba_layers, 1,
    *shape]``; ``page_size`` 1."""

    def __init__(self, device_pool, size, layout="layer_first", seed=0):
        self.device_pool, self.size, self.layout, self.page_size = device_pool, size, layout, 1
        self.num_mamba_layers = device_pool.num_mamba_layers
        gen = torch.Generator().manual_seed(seed)
        L = self.num_mamba_layers

        def alloc(like):
            shape = tuple(like.shape[2:])
            dims = (size, L, 1) + shape if layout.startswith("page_first") else (L, size) + shape
            return _rand(dims, like.dtype, gen)

        self.conv_buffer = [alloc(c) for c in device_pool.mamba_cache.conv]
        self.temporal_buffer = alloc(device_pool.mamba_cache.temporal)
