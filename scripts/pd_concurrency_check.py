"""Are P/D answers under concurrency the answers alone? The reproduction of the wrong-answer bug the fleet
soak found (issue 29, docs/reliability.md "The fleet soak"): a render server and a P/D pair of qwen3-tiny
(float32, --batch-invariant) on loopback, the eight short completions prompts of the soak, each answered
alone through direct prefill and decode legs, then 48 at a time from 32 threads, in rounds.

    .venv/bin/python scripts/pd_concurrency_check.py [--rounds 4]

Prints the wrong answers per round; on 2026-12-06 it printed 3-15 of 48 per round (0 with no block reuse on
the prefill side).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import sys
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve.checkpoints.resolve import resolve_model  # noqa: E402
from pdserve.proxy.legs import decode_body, prefill_body  # noqa: E402
from pdserve.topology.process import start_all, stop_all  # noqa: E402
from tests.serverproc import ServerProcess  # noqa: E402

ENGINE = ("qwen3-tiny", "--dtype", "float32", "--batch-invariant", "--kv-transfer", "nixl")
TOPICS = ["Paris", "the sea", "a clock", "rain", "bread", "a violin", "winter", "trains"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    render = ServerProcess("launch", "render", "--tokenizer", str(resolve_model("qwen3-tiny")))
    prefill = ServerProcess("serve", *ENGINE, "--tokens-only", "--kv-role", "prefill")
    decode = ServerProcess("serve", *ENGINE, "--kv-role", "decode")
    servers = [render, prefill, decode]
    start_all(servers)
    try:
        rendered = {t: httpx.post(render.url + "/v1/completions/render", json={
            "model": "qwen3-tiny", "prompt": f"A few words about {t}:", "max_tokens": 48, "ignore_eos": True,
            "temperature": 0}).json()[0] for t in TOPICS}

        def answer(topic: str) -> object:
            legs = httpx.post(prefill.url + "/inference/v1/generate", json=prefill_body(rendered[topic]), timeout=60)
            body = decode_body(rendered[topic], "tokens", legs.json()["kv_transfer_params"])
            out = httpx.post(decode.url + "/inference/v1/generate", json=body, timeout=60).json()
            return out["choices"][0]["token_ids"] if "choices" in out else out

        alone = {t: answer(t) for t in TOPICS}
        wrong_total = 0
        for round_ in range(1, args.rounds + 1):
            with concurrent.futures.ThreadPoolExecutor(32) as pool:
                jobs = [(t, pool.submit(answer, t)) for _ in range(6) for t in TOPICS]
                wrong = sum(job.result() != alone[t] for t, job in jobs)
            wrong_total += wrong
            print(f"round {round_}: {wrong} of {len(jobs)} answers differ from the answer alone", flush=True)
        return 1 if wrong_total else 0
    finally:
        stop_all(servers)


if __name__ == "__main__":
    raise SystemExit(main())
