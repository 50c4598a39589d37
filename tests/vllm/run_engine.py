"""Serve a tiny model with vLLM (CPU build) and report what each prompt gave.

    python tests/vllm/run_engine.py --model gemma3 --connector kvgroups --out result.json

Prompts run one at a time, in order (a prompt's saves land before the next one's lookup):
``first`` (700 tokens), ``repeat`` (the same), ``shared`` (first 600 tokens of ``first`` then
300 others: a 512-token common prefix in whole chunks), ``unrelated`` (700 other tokens).
Writes ``{"outputs": {name: [token ids]}, "cached": {name: num_cached_tokens}}``.
vLLM spawns its engine process, hence the ``__main__`` guard.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# The CPU build of vLLM reserves one more core for the scheduler when a KV connector is
# configured: on a 2-core machine the runs without a connector computed on one thread and those
# with one on two, and bf16 sums taken in another order flipped a greedy near-tie at the fifth
# generated token (with vLLM's own ExampleConnector too). Every run computes on core 0 alone,
# so the runs differ in the connector only.
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0")

from tiny_models import build  # noqa: E402


def prompts(length: int = 700) -> dict[str, list[int]]:
    import random

    rng = random.Random(1234)
    first = [rng.randrange(1, 1000) for _ in range(length)]
    tail = [rng.randrange(1, 1000) for _ in range(300)]
    unrelated = [rng.randrange(1, 1000) for _ in range(700)]
    return {
        "first": first,
        "repeat": list(first),
        "shared": first[:600] + tail,
        "unrelated": unrelated,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument(
        "--connector",
        choices=("none", "kvgroups", "corrupt", "scrambled", "unwaited", "example", "split512"),
        default="none",
        help="corrupt: the test-only subclass that scrambles what "
        "it loads; scrambled / unwaited: the test-only subclasses that scramble the "
        "blocks a load fills, before it (unwaited also skips the per-layer waits); "
        "example: vLLM's own ExampleConnector (disk), for comparison",
    )
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=700)
    ap.add_argument("--out", required=True)
    ap.add_argument("--model-dir", default=os.path.join(tempfile.gettempdir(), "kvgroups-tiny"))
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument(
        "--stats",
        action="store_true",
        help="turn vLLM's stat logging on and report the kvgroups_* metrics",
    )
    args = ap.parse_args()
    model_dir = build(args.model, os.path.join(args.model_dir, args.model))

    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    kw = {}
    if args.connector == "example":
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="ExampleConnector",
            kv_role="kv_both",
            kv_connector_extra_config={"shared_storage_path": tempfile.mkdtemp()},
        )
    elif args.connector == "split512":
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="FixedSplitExampleConnector",
            kv_connector_module_path="fixed_split_connector",
            kv_role="kv_both",
            kv_connector_extra_config={
                "shared_storage_path": tempfile.mkdtemp(),
                "load_tokens": 512,
            },
        )
    elif args.connector != "none":
        name, module = {
            "kvgroups": ("KVGroupsConnector", "kvgroups_torch.vllm"),
            "corrupt": ("CorruptingConnector", "corrupt_connector"),
            "scrambled": ("ScrambledTargetConnector", "scrambled_connector"),
            "unwaited": ("UnwaitedConnector", "scrambled_connector"),
        }[args.connector]
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector=name,
            kv_connector_module_path=module,
            kv_role="kv_both",
            kv_connector_extra_config={"capacity_chunks": 64, "chunk_size": args.chunk},
        )
    t0 = time.time()
    llm = LLM(
        model=model_dir,
        skip_tokenizer_init=True,
        dtype="bfloat16",
        enforce_eager=True,
        enable_prefix_caching=False,
        max_model_len=2048,
        kv_cache_memory_bytes=64 << 20,
        gpu_memory_utilization=0.1,
        seed=0,
        disable_log_stats=not args.stats,
        **kw,
    )
    started = time.time() - t0
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, detokenize=False)
    result = {"outputs": {}, "cached": {}, "start_s": started}
    for name, ids in prompts(args.prompt_len).items():
        (out,) = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
        result["outputs"][name] = list(out.outputs[0].token_ids)
        result["cached"][name] = int(out.num_cached_tokens or 0)
    if args.stats:
        llm.llm_engine.do_log_stats()  # vLLM's "KV Transfer metrics: ..." line, now
        result["metrics"] = {
            m.name: m.value for m in llm.get_metrics() if m.name.startswith("vllm:kvgroups_")
        }
    result["total_s"] = time.time() - t0
    with open(args.out, "w") as f:
        json.dump(result, f)
    print(json.dumps(result["cached"]), flush=True)


if __name__ == "__main__":
    main()
