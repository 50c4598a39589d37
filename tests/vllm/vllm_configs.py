"""vLLM KVCacheConfigs built from vLLM's own classes, and the tensors vLLM's own allocator
(``vllm.v1.worker.utils.allocate_kv_cache``) makes from them: what ``register_kv_caches`` gets."""

from __future__ import annotations

import torch
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.worker.utils import allocate_kv_cache

BS = 128
NB = 12
DT = torch.bfloat16


def name(i: int) -> str:
    return f"model.layers.{i}.self_attn.attn"


def full(heads: int = 2, head: int = 64, **kw) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=BS, num_kv_heads=heads, head_size=head, dtype=DT, **kw)


def sliding(window: int = 128, heads: int = 2, head: int = 64) -> SlidingWindowSpec:
    return SlidingWindowSpec(
        block_size=BS, num_kv_heads=heads, head_size=head, dtype=DT, sliding_window=window
    )


def chunked(local: int, heads: int = 2, head: int = 64) -> ChunkedLocalAttentionSpec:
    return ChunkedLocalAttentionSpec(
        block_size=BS, num_kv_heads=heads, head_size=head, dtype=DT, attention_chunk_size=local
    )


def mla(latent: int = 96) -> MLAAttentionSpec:
    return MLAAttentionSpec(block_size=BS, num_kv_heads=1, head_size=latent, dtype=DT)


def gdn(conv=(3, 64), temporal=(2, 16, 16), mode="align", pad_to=None) -> MambaSpec:
    """A Gated DeltaNet state (conv bf16 in vLLM's default SD orientation, temporal f32),
    padded to ``pad_to`` bytes (vLLM pads Mamba pages to the attention page)."""
    return MambaSpec(
        block_size=BS,
        shapes=(conv, temporal),
        dtypes=(DT, torch.float32),
        page_size_padded=pad_to,
        mamba_type=MambaAttentionBackendEnum.GDN_ATTN,
        mamba_cache_mode=mode,
    )


def uniform(specs: dict) -> UniformTypeKVCacheSpecs:
    return UniformTypeKVCacheSpecs(block_size=BS, kv_cache_specs=specs)


def config(
    groups: list[tuple[list[int], object]],
    layout: str = "LBHNC",
    num_blocks: int = NB,
    blocks_outer: bool = False,
) -> KVCacheConfig:
    """One KVCacheGroupSpec per (layers, spec), in the given (vLLM's) order, and the tensors
    vLLM's hybrid allocator makes: layer j of every group overlays the same bytes of one
    backing buffer (one block pool, ids handed out per group). ``blocks_outer``: the
    cross-layer placement (block b of every layer side by side), per-layer block stride
    ``depth * page``."""

    def spec_of(spec, i):
        return spec.kv_cache_specs[name(i)] if isinstance(spec, UniformTypeKVCacheSpecs) else spec

    depth = max(len(layers) for layers, _ in groups)
    page = max(spec_of(s, i).page_size_bytes for layers, s in groups for i in layers)
    size = num_blocks * page * depth
    tensors = []
    for layers, spec in groups:
        for j, i in enumerate(layers):
            if blocks_outer:
                tensors.append(
                    KVCacheTensor(
                        size=size,
                        layers=[name(i)],
                        layer_stride=page,
                        block_stride=depth * page,
                        offset=j * page,
                    )
                )
            else:
                tensors.append(
                    KVCacheTensor(
                        size=size,
                        layers=[name(i)],
                        layer_stride=num_blocks * page,
                        block_stride=spec_of(spec, i).page_size_bytes,
                        offset=j * num_blocks * page,
                    )
                )
    kv_groups = [KVCacheGroupSpec([name(i) for i in layers], spec) for layers, spec in groups]
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=tensors,
        kv_cache_groups=kv_groups,
        kv_cache_layout=layout,
    )


def caches(cfg: KVCacheConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """vLLM's own allocation of ``cfg`` (one int8 buffer, per-layer views), random bytes."""
    out = allocate_kv_cache(cfg, torch.device("cpu"), KVCacheLayout[cfg.kv_cache_layout])
    base = next(iter(out.values()))
    storage = torch.empty(0, dtype=torch.uint8).set_(base.untyped_storage())
    gen = torch.Generator().manual_seed(seed)
    storage.copy_(torch.randint(0, 256, storage.shape, dtype=torch.uint8, generator=gen))
    return out


def backing(kv: dict[str, torch.Tensor]) -> torch.Tensor:
    """The one uint8 buffer every view of ``kv`` lives in."""
    base = next(iter(kv.values()))
    return torch.empty(0, dtype=torch.uint8).set_(base.untyped_storage())
