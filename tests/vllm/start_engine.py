"""Start vLLM (CPU build) on a tiny model with KVGroupsConnector configured as asked, run one
short prompt, and report whether the engine started and, if not, what it raised.

    python tests/vllm/start_engine.py --role kv_both --extra '{"capacity_chunk": 8}' --out r.json

Writes ``{"started": bool, "error_type": name, "error": text}``; the text includes the chained
causes, so an error raised in the engine's own process can be matched. vLLM spawns its engine
process, hence the ``__main__`` guard.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0")  # see run_engine.py

from tiny_models import build  # noqa: E402


def _chain(exc: BaseException) -> str:
    parts, seen = [], set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        parts.append(f"{type(exc).__name__}: {exc}")
        exc = exc.__cause__ or exc.__context__
    return " <- ".join(parts)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama")
    ap.add_argument("--role", default="kv_both")
    ap.add_argument("--extra", default="{}", help="kv_connector_extra_config as JSON")
    ap.add_argument("--out", required=True)
    ap.add_argument("--model-dir", default=os.path.join(tempfile.gettempdir(), "kvgroups-tiny"))
    args = ap.parse_args()
    model_dir = build(args.model, os.path.join(args.model_dir, args.model))

    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    result: dict = {"started": False, "error_type": None, "error": None}
    try:
        transfer = KVTransferConfig(
            kv_connector="KVGroupsConnector",
            kv_connector_module_path="kvgroups_torch.vllm",
            kv_role=args.role,
            kv_connector_extra_config=json.loads(args.extra),
        )
        llm = LLM(
            model=model_dir,
            skip_tokenizer_init=True,
            dtype="bfloat16",
            enforce_eager=True,
            enable_prefix_caching=False,
            max_model_len=1024,
            kv_cache_memory_bytes=32 << 20,
            gpu_memory_utilization=0.1,
            seed=0,
            kv_transfer_config=transfer,
        )
        params = SamplingParams(max_tokens=2, temperature=0.0, detokenize=False)
        llm.generate([TokensPrompt(prompt_token_ids=list(range(1, 300)))], params, use_tqdm=False)
        result["started"] = True
    except Exception as exc:  # noqa: BLE001 - reported to the test
        result["error_type"] = type(exc).__name__
        result["error"] = _chain(exc)
    with open(args.out, "w") as f:
        json.dump(result, f)
    print(json.dumps(result)[:2000], flush=True)


if __name__ == "__main__":
    main()
