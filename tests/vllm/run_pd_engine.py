"""One engine of a disaggregated prefill/decode pair (vLLM CPU build, KVGroupsConnector).

    python tests/vllm/run_pd_engine.py --role producer --model llama --dir DIR --port 5611
    python tests/vllm/run_pd_engine.py --role consumer --model llama --dir DIR

The two processes talk through files in DIR, doing what a proxy does:

- producer: first the single-engine reference (every prompt with ``max_tokens=8``, under
  another cache salt so nothing it saves is reused), then each prompt as a prefill request
  (``kv_transfer_params={"do_remote_decode": True}``, ``max_tokens=1``); the output's
  ``kv_transfer_params`` minus ``remote_prefill_cached_tokens`` (vLLM 0.32's scheduler adds
  the producer's prefix hits there, and the consumer would report them as its own cached
  tokens) go to ``DIR/params-NAME.json``. It then serves pulls until ``DIR/stop`` appears.
- consumer: each prompt with the producer's params (``max_tokens=8``) -> its tokens and
  ``num_cached_tokens``; then ``DIR/stop``, waits for the producer to exit, and sends the
  last prompt's params, whose writer is now gone: the pull fails and the engine recomputes
  (``kv_load_failure_policy="recompute"``).

Results: ``DIR/producer.json`` and ``DIR/consumer.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0")  # see run_engine.py

from run_engine import prompts  # noqa: E402
from tiny_models import build  # noqa: E402

NAMES = ("first", "unrelated", "late")  # "late" is pulled only after the producer has gone
MAX_TOKENS = 8


def wait_for(path: Path, timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.1)


def sampled_logprobs(output) -> list[float]:
    """The log-probability of each generated token (as sensitive to the KV as the tokens are
    not: a random model's greedy tokens may repeat one token)."""
    out = output.outputs[0]
    return [float(step[token].logprob) for token, step in zip(out.token_ids, out.logprobs)]


def engine(model_dir: str, role: str, port: int):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    extra = {
        "chunk_size": 256,
        "capacity_chunks": 64,
        "transport": "nixl",
        "nixl_backends": ["UCX"],
        "side_channel_host": "127.0.0.1",
        "side_channel_port": port,
        "pull_timeout_s": 20.0,
    }
    config = KVTransferConfig(
        kv_connector="KVGroupsConnector",
        kv_connector_module_path="kvgroups_torch.vllm",
        kv_role=role,
        kv_buffer_device="cpu",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config=extra,
    )
    return LLM(
        model=model_dir,
        skip_tokenizer_init=True,
        dtype="bfloat16",
        enforce_eager=True,
        enable_prefix_caching=False,
        max_model_len=2048,
        kv_cache_memory_bytes=64 << 20,
        gpu_memory_utilization=0.1,
        seed=0,
        kv_transfer_config=config,
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--role", choices=("producer", "consumer"), required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--port", type=int, default=5611)
    ap.add_argument("--model-dir", default=os.path.join(tempfile.gettempdir(), "kvgroups-tiny"))
    args = ap.parse_args()
    out = Path(args.dir)
    model_dir = build(args.model, os.path.join(args.model_dir, args.model))
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    texts = {k: v for k, v in prompts().items() if k in ("first", "unrelated")}
    texts["late"] = [(t * 7 + 3) % 997 + 1 for t in texts["first"]]
    t0 = time.time()
    if args.role == "producer":
        llm = engine(model_dir, "kv_producer", args.port)
        result = {
            "start_s": time.time() - t0,
            "reference": {},
            "reference_logprobs": {},
            "params": {},
        }
        plain = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, detokenize=False, logprobs=1)
        for name in NAMES:
            (o,) = llm.generate(
                [TokensPrompt(prompt_token_ids=texts[name], cache_salt="reference")],
                plain,
                use_tqdm=False,
            )
            result["reference"][name] = list(o.outputs[0].token_ids)
            result["reference_logprobs"][name] = sampled_logprobs(o)
        for name in NAMES:
            prefill = SamplingParams(
                max_tokens=1,
                temperature=0.0,
                detokenize=False,
                extra_args={"kv_transfer_params": {"do_remote_decode": True}},
            )
            (o,) = llm.generate(
                [TokensPrompt(prompt_token_ids=texts[name])], prefill, use_tqdm=False
            )
            params = dict(o.kv_transfer_params or {})
            result["params"][name] = dict(params)
            params.pop("remote_prefill_cached_tokens", None)  # what a proxy does
            (out / f"params-{name}.json").write_text(json.dumps(params))
        (out / "producer.json").write_text(json.dumps(result))
        wait_for(out / "stop")
        return
    llm = engine(model_dir, "kv_consumer", args.port)
    result = {"start_s": time.time() - t0, "outputs": {}, "logprobs": {}, "cached": {}}

    def decode(name: str) -> None:
        params = json.loads((out / f"params-{name}.json").read_text())
        sp = SamplingParams(
            max_tokens=MAX_TOKENS,
            temperature=0.0,
            detokenize=False,
            logprobs=1,
            extra_args={"kv_transfer_params": params},
        )
        (o,) = llm.generate([TokensPrompt(prompt_token_ids=texts[name])], sp, use_tqdm=False)
        result["outputs"][name] = list(o.outputs[0].token_ids)
        result["logprobs"][name] = sampled_logprobs(o)
        result["cached"][name] = int(o.num_cached_tokens or 0)

    for name in NAMES:
        wait_for(out / f"params-{name}.json")
    for name in NAMES[:-1]:
        decode(name)
    (out / "stop").write_text("")
    wait_for(out / "producer.exited")
    decode(NAMES[-1])
    (out / "consumer.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
