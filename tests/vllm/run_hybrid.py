"""Serve the tiny Qwen3-Next (Gated DeltaNet + attention) with vLLM's CPU build and
KVGroupsConnector, in one process, and report what every request scenario gave.

    python tests/vllm/run_hybrid.py --out result.json

vLLM keeps recurrent-state snapshots only in ``mamba_cache_mode="align"``, which needs its
prefix caching on: the cache is reset before every request, and every block of the engine's KV
cache and state pages is overwritten with random values, so every cached token a request
reports came from the connector and nothing a request reads is left over from an earlier one
(vLLM hands freed blocks out again, and a stale state block of the same prompt would pass for a
loaded one). Prefill runs in 512-token steps and vLLM retains a snapshot every 512 tokens
(``prefix_cache_retention_interval``), so snapshots exist at 512 and 1,024 tokens, not at 256
or 768: a prompt sharing 768 tokens with a cached one hits three chunks of attention KV but
only two of state. Scenarios, in order (``*-ref`` is the same prompt under a cache salt of its
own: nothing cached, the run without any cache): ``first`` (1,025 tokens), ``repeat``,
``shared768`` (768 tokens of ``first`` and one more) and ``shared768-ref``, ``shared300`` (one
chunk of attention, no snapshot), ``unrelated``. The connector's own view is reported too:
after every request, per chunk of ``first``, which object groups its index holds (attention,
and the state snapshot), and at the end the worker's load/save counts.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0")  # one compute thread (run_engine.py)
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the connectors in this process

from tiny_models import build  # noqa: E402


def prompts() -> list[tuple[str, list[int], str | None]]:
    """(label, prompt, cache salt). Each prompt ends one token after the prefix a hit can
    load: a recurrent state forgets old tokens within a few steps, so only a short
    continuation shows whether the state a request starts from is right."""
    import random

    rng = random.Random(4321)
    first = [rng.randrange(1, 1000) for _ in range(1025)]
    tail = [rng.randrange(1, 1000) for _ in range(3)]
    shared768 = first[:768] + tail[:1]  # attention hits 3 chunks, the state only 2
    return [
        ("first", first, None),
        ("repeat", list(first), None),
        ("shared768", shared768, None),
        ("shared768-ref", shared768, "ref"),
        ("shared300", first[:300] + tail, None),
        ("unrelated", [rng.randrange(1, 1000) for _ in range(700)], None),
    ]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--model-dir", default=os.path.join(tempfile.gettempdir(), "kvgroups-tiny"))
    ap.add_argument(
        "--connector",
        choices=("kvgroups", "no-state-load"),
        default="kvgroups",
        help="no-state-load: the test-only subclass that loads attention KV alone",
    )
    ap.add_argument("--max-tokens", type=int, default=8)
    args = ap.parse_args()
    model_dir = build("qwen3_next", os.path.join(args.model_dir, "qwen3_next"))

    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from vllm.inputs import TokensPrompt

    name, module = (
        ("KVGroupsConnector", "kvgroups_torch.vllm")
        if args.connector == "kvgroups"
        else ("NoStateLoadConnector", "no_state_load_connector")
    )
    t0 = time.time()
    llm = LLM(
        model=model_dir,
        skip_tokenizer_init=True,
        dtype="bfloat16",
        enforce_eager=True,
        enable_prefix_caching=True,
        max_model_len=2048,
        max_num_batched_tokens=512,
        max_num_seqs=4,
        kv_cache_memory_bytes=256 << 20,
        seed=0,
        prefix_cache_retention_interval=512,
        kv_transfer_config=KVTransferConfig(
            kv_connector=name,
            kv_connector_module_path=module,
            kv_role="kv_both",
            kv_connector_extra_config={"capacity_chunks": 64, "chunk_size": 256},
        ),
    )
    started = time.time() - t0
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, detokenize=False)
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler.connector
    result = {
        "outputs": {},
        "cached": {},
        "start_s": started,
        "mamba_cache_mode": llm.llm_engine.vllm_config.cache_config.mamba_cache_mode,
    }
    from kvgroups_torch.vllm.prefix_index import chunk_hashes

    first_hashes = chunk_hashes(prompts()[0][1], 256)
    gen = __import__("torch").Generator().manual_seed(99)
    for label, ids, salt in prompts():
        llm.reset_prefix_cache()
        for cache in get_kv_transfer_group()._layout.kv_caches:  # the worker's own tensors
            cache.copy_(cache.new_empty(cache.shape).uniform_(-1, 1, generator=gen))
        prompt = TokensPrompt(prompt_token_ids=ids)
        if salt is not None:
            prompt["cache_salt"] = salt
        (out,) = llm.generate([prompt], params, use_tqdm=False)
        result["outputs"][label] = list(out.outputs[0].token_ids)
        result["cached"][label] = int(out.num_cached_tokens or 0)
        # The scheduler's index: per chunk of `first`, which object groups are cached.
        result.setdefault("first_chunks", {})[label] = scheduler._index.present(
            first_hashes, len(scheduler._attn.num_chunks_in_sw)
        ).tolist()
    result["state_object_groups"] = sorted(scheduler._state_ogs)
    result["worker_stats"] = dict(get_kv_transfer_group().stats)
    result["total_s"] = time.time() - t0
    with open(args.out, "w") as f:
        json.dump(result, f)
    print(
        json.dumps({k: result[k] for k in ("cached", "worker_stats", "start_s", "total_s")}),
        flush=True,
    )


if __name__ == "__main__":
    main()
