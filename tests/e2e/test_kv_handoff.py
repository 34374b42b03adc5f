"""KV hand-off between real pdserve servers over NIXL (issue 9): the prefill leg's KV reaches the decode
server, which decodes exactly what one coupled server answers; failures fail or recompute as configured;
unpulled KV expires. The legs are sent as a router sends them (vLLM NixlConnector's kv_transfer_params).

Where the answers must be bit-equal the servers run in float32. A decode leg computes its first token in a
decode step over the pulled KV, a coupled server takes it from its prefill's last row: two kernels, which in
bfloat16 round the logits differently (one bf16 step; a tie on one path is a 0.125 gap on the other on an
Intel host without native bf16). The bfloat16 pair is held to what bf16 can promise: the same token wherever
its top two candidates are further apart than that rounding (checked from the logprobs)."""

from __future__ import annotations

import concurrent.futures
import random
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from pdserve.topology.process import free_port, start_all
from tests.serverproc import ServerProcess
from tests.sse import parse_sse
from tests.waiting import wait_until

MODEL = "smollm2-135m"  # a real model: greedy answers that vary, so equality means something
KV = ("--kv-transfer", "nixl")
EXACT = ("--dtype", "float32")  # bit-equal answers across the prefill and decode kernels (module docstring)
GENERATE = "/inference/v1/generate"
KV_KEYS = {
    "do_remote_prefill", "do_remote_decode", "remote_block_ids", "remote_engine_id", "remote_request_id",
    "remote_host", "remote_port", "remote_num_tokens", "remote_blocks_expiry_time", "tp_size",
}


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, ServerProcess]]:
    group = {
        "prefill": ServerProcess("serve", MODEL, *KV, *EXACT),
        "decode": ServerProcess("serve", MODEL, *KV, *EXACT),
        # One engine slot: pulled decode legs queue for it (the wrong-answer bug of issue 29's soak). A failed
        # pull is computed here instead (the policy acts only on a failure: the queued legs' pulls succeed).
        "narrow": ServerProcess("serve", MODEL, *KV, *EXACT, "--max-num-seqs", "1",
                                "--kv-load-failure-policy", "recompute"),
        "doomed": ServerProcess("serve", MODEL, *KV, *EXACT),  # a prefill server this module kills
        "prefill_bf16": ServerProcess("serve", MODEL, *KV),
        "decode_bf16": ServerProcess("serve", MODEL, *KV),
        "short_lease": ServerProcess("serve", "qwen3-tiny", *KV, "--kv-lease-s", "1"),
        "plain": ServerProcess("serve", "--engine", "scripted"),
    }
    try:
        start_all(list(group.values()), timeout_s=300)
        yield group
    finally:
        for server in group.values():
            server.stop()


def prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 49152) for _ in range(rng.randrange(2, 300))] for _ in range(count)]


def post(server: ServerProcess, body: dict[str, Any], timeout: float = 120) -> httpx.Response:
    return httpx.post(server.url + GENERATE, json=body, timeout=timeout)


def prefill_leg(server: ServerProcess, token_ids: list[int]) -> dict[str, Any]:
    """What a router sends first: max_tokens=1, no stream, do_remote_decode; returns the params."""
    r = post(server, {"token_ids": token_ids, "sampling_params": {"max_tokens": 1, "temperature": 0},
                      "kv_transfer_params": {"do_remote_decode": True}})
    assert r.status_code == 200, r.text
    params = r.json()["kv_transfer_params"]
    assert set(params) == KV_KEYS
    return params


def decode_body(token_ids: list[int], params: dict[str, Any] | None, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"token_ids": token_ids, "sampling_params": {"max_tokens": 24, "temperature": 0}, **extra}
    if params is not None:
        body["kv_transfer_params"] = params
    return body


def process_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except FileNotFoundError:
        return False


def reaches(server: ServerProcess, name: str, value: float) -> None:
    """Engine counters reach /metrics with the core's next heartbeat: wait for the one a check is about
    (the other engine figures in the same scrape are from that same snapshot)."""
    wait_until(lambda: server.metric(name) == value, f"{name} == {value} on {server.url}")


def answer(r: httpx.Response) -> list[int]:
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def test_decode_leg_equals_one_coupled_server_and_metrics_show_the_hand_off(servers) -> None:  # type: ignore[no-untyped-def]
    p, d = servers["prefill"], servers["decode"]
    computed_p = p.metric("pdserve_engine_prompt_tokens_computed_total")
    computed_d = d.metric("pdserve_engine_prompt_tokens_computed_total")
    pulled_bytes, pulls = d.metric("pdserve_kv_pulled_bytes_total"), d.metric("pdserve_kv_pulls_ok_total")
    batch = prompts(6, seed=1)
    via_pd = []
    for token_ids in batch:
        params = prefill_leg(p, token_ids)
        assert params["remote_num_tokens"] == len(token_ids)
        assert params["remote_port"] == p.port
        via_pd.append(answer(post(d, decode_body(token_ids, params))))
    # The prefill server ran every prompt; the decode server pulled their KV and computed none of them.
    reaches(p, "pdserve_engine_prompt_tokens_computed_total", computed_p + sum(map(len, batch)))
    reaches(d, "pdserve_kv_pulls_ok_total", pulls + len(batch))
    assert d.metric("pdserve_engine_prompt_tokens_computed_total") == computed_d
    assert d.metric("pdserve_kv_pulled_bytes_total") > pulled_bytes
    assert d.metric("pdserve_kv_recomputes_total") == 0
    # Pulled KV is freed on the prefill side by the decode engine's notification, not by expiry.
    wait_until(lambda: p.metric("pdserve_kv_held_blocks") == 0, "prefill KV freed after the pulls")
    assert p.metric("pdserve_kv_leases_pulled_total") >= len(batch)
    assert p.metric("pdserve_kv_free_slots") == p.metric("pdserve_kv_slots")
    coupled = [answer(post(d, decode_body(token_ids, None))) for token_ids in batch]
    assert via_pd == coupled
    assert len({t for ids in coupled for t in ids}) > 10  # answers that differ: the check can fail


def test_decode_legs_that_queue_for_a_slot_decode_their_own_prompts_kv(servers) -> None:  # type: ignore[no-untyped-def]
    """More decode legs than engine slots, while the prefill server keeps exporting: a pulled leg waits in
    the decode engine's queue (or for a slot to READ into), and the prefill engine has freed its slots (the
    READ notified) and reuses them for the next prompts. Every answer must still be the coupled one. Before the
    fix of issue 29 a waiting leg READ its KV again every step and decoded from another prompt's KV."""
    p, d = servers["prefill"], servers["narrow"]
    batch = [ids[:64] for ids in prompts(8, seed=7)]
    short = {"max_tokens": 12, "temperature": 0}  # the one slot decodes the 16 answers one after another

    def via_pd(token_ids: list[int]) -> list[int]:
        return answer(post(d, decode_body(token_ids, prefill_leg(p, token_ids), sampling_params=short)))

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        got = list(pool.map(via_pd, batch))
    coupled = [answer(post(d, decode_body(token_ids, None, sampling_params=short))) for token_ids in batch]
    assert got == coupled
    assert len({tuple(ids) for ids in coupled}) == len(batch)  # every prompt its own answer: a mix-up shows
    wait_until(lambda: p.metric("pdserve_kv_held_blocks") == 0, "prefill KV freed after the pulls")


# How far apart a bfloat16 answer's best candidates must be for both paths to pick the same one. The
# logits come out of the bf16 projection rounded to bf16: at the magnitudes SmolLM2's top logits take
# (16..32) one bf16 step is 0.125, and a row's hidden state carries rounding of its own from the other
# kernel. Measured on an Intel host without native bf16: of 66 prompts × 24 greedy tokens, 4 answers went
# another way, each at its first token, where one path had a tie (once of three candidates) and the other
# the same candidates one step (0.125) apart. The bound is two steps.
BF16_FLIP_BOUND = 0.25
CANDIDATES = 5  # enough to see a three-way tie and the other path's pick among them


def top_candidates(r: httpx.Response) -> tuple[list[int], list[dict[int, float]]]:
    """A batch answer's ids and, per position, its candidates' logprobs by id."""
    choice = r.json()["choices"][0]
    return choice["token_ids"], [{c["token_id"]: c["logprob"] for c in pos["top_logprobs"]}
                                 for pos in choice["logprobs"]["content"]]


def test_bf16_decode_leg_equals_coupled_wherever_bf16_can_tell_the_candidates_apart(servers) -> None:  # type: ignore[no-untyped-def]
    p, d = servers["prefill_bf16"], servers["decode_bf16"]
    pulls = d.metric("pdserve_kv_pulls_ok_total")
    batch = prompts(6, seed=1)
    checked = 0
    for token_ids in batch:
        params = prefill_leg(p, token_ids)
        pd_ids, pd_top = top_candidates(post(d, decode_body(token_ids, params, sampling_params={
            "max_tokens": 24, "temperature": 0, "logprobs": CANDIDATES})))
        ids, top = top_candidates(post(d, decode_body(token_ids, None, sampling_params={
            "max_tokens": 24, "temperature": 0, "logprobs": CANDIDATES})))
        for pos, (mine, theirs) in enumerate(zip(ids, pd_ids, strict=True)):
            if mine == theirs:
                checked += 1
                continue
            # A different pick is a near tie on both paths (each has the other's pick among its best few),
            # and the answers go separate ways after it: nothing further to compare.
            gap = top[pos][mine] - top[pos].get(theirs, float("-inf"))
            pd_gap = pd_top[pos][theirs] - pd_top[pos].get(mine, float("-inf"))
            assert gap <= BF16_FLIP_BOUND and pd_gap <= BF16_FLIP_BOUND, (
                f"prompt of {len(token_ids)} ids, position {pos}: coupled {mine} (gap {gap:.4f}) vs P/D {theirs} "
                f"(gap {pd_gap:.4f}); more than bf16 rounding apart")
            break
    reaches(d, "pdserve_kv_pulls_ok_total", pulls + len(batch))
    # Half the positions at least are compared, so the check can fail. (On the Intel host without native
    # bf16, two of these six answers went another way at their first token: 96 of 144 positions.)
    assert checked >= len(batch) * 24 // 2


def test_streamed_text_decode_leg_equals_coupled_text(servers) -> None:  # type: ignore[no-untyped-def]
    p, d = servers["prefill"], servers["decode"]
    token_ids = prompts(1, seed=2)[0]
    params = prefill_leg(p, token_ids)
    with httpx.stream("POST", d.url + GENERATE, timeout=120,
                      json=decode_body(token_ids, params, output_mode="text", stream=True)) as r:
        assert r.status_code == 200
        events, done = parse_sse(list(r.iter_lines()))
    assert done
    streamed = "".join(c["text"] for e in events for c in e["choices"])
    coupled = post(d, decode_body(token_ids, None, output_mode="text")).json()["choices"][0]["text"]
    assert streamed == coupled and streamed


def unreachable(params: dict[str, Any]) -> dict[str, Any]:
    """The params of a prefill engine whose server is gone (nothing listens on the port)."""
    return {**params, "remote_port": free_port(), "remote_engine_id": "pdserve-gone"}


def test_failed_pull_fails_with_502_naming_the_cause_batch_and_stream(servers) -> None:  # type: ignore[no-untyped-def]
    p, d = servers["prefill"], servers["decode"]
    token_ids = prompts(1, seed=3)[0]
    params = unreachable(prefill_leg(p, token_ids))
    failed = d.metric("pdserve_kv_pulls_failed_total")
    r = post(d, decode_body(token_ids, params))
    assert r.status_code == 502, r.text
    error = r.json()["error"]
    assert error["type"] == "KVLoadError" and "KV load failed" in error["message"] and "/kv/metadata" in error["message"]
    with httpx.stream("POST", d.url + GENERATE, json=decode_body(token_ids, params, stream=True), timeout=60) as s:
        events, done = parse_sse(list(s.iter_lines()))
    assert done and events[-1]["error"]["code"] == 502 and "KV load failed" in events[-1]["error"]["message"]
    reaches(d, "pdserve_kv_pulls_failed_total", failed + 2)
    assert d.metric('pdserve_requests_total{endpoint="generate",output_mode="tokens",status="502"}') >= 2


def test_recompute_policy_answers_correctly_and_counts_one_recompute(servers) -> None:  # type: ignore[no-untyped-def]
    p, d = servers["prefill"], servers["narrow"]
    token_ids = prompts(1, seed=4)[0]
    params = unreachable(prefill_leg(p, token_ids))
    before = d.metric("pdserve_kv_recomputes_total")
    recomputed = answer(post(d, decode_body(token_ids, params)))
    reaches(d, "pdserve_kv_recomputes_total", before + 1)
    assert recomputed == answer(post(d, decode_body(token_ids, None)))


def test_killed_prefill_server_fails_the_pull_of_a_known_peer(servers) -> None:  # type: ignore[no-untyped-def]
    doomed, d = servers["doomed"], servers["decode"]
    first, second = prompts(2, seed=5)
    answer(post(d, decode_body(first, prefill_leg(doomed, first))))  # the decode engine now knows this peer
    params = prefill_leg(doomed, second)
    core_pid = int(httpx.get(doomed.url + "/health").headers["x-pdserve-core-pid"])
    doomed.stop()
    wait_until(lambda: not process_alive(core_pid), "the killed server's engine core (the NIXL agent) is gone")
    r = post(d, decode_body(second, params))
    assert r.status_code == 502, r.text
    assert "KV load failed" in r.json()["error"]["message"]
    assert httpx.get(d.url + "/health").status_code == 200  # the decode server itself is fine
    assert answer(post(d, decode_body(second, None)))


def test_unpulled_kv_expires_and_a_late_pull_is_refused(servers) -> None:  # type: ignore[no-untyped-def]
    p, d = servers["short_lease"], servers["decode"]
    token_ids = [5, 6, 7, 8] * 10
    params = prefill_leg(p, token_ids)
    assert len(params["remote_block_ids"][0]) == 3  # 40 positions in 16-position blocks (of the slot it ran in)
    reaches(p, "pdserve_kv_leases_expired_total", 1)
    assert p.metric("pdserve_kv_held_blocks") == 0
    assert p.metric("pdserve_kv_free_slots") == p.metric("pdserve_kv_slots")
    r = post(d, decode_body(token_ids, params))
    assert r.status_code == 502 and "expired" in r.json()["error"]["message"]


@pytest.mark.parametrize(
    ("params", "needle"),
    [
        ({"do_remote_decode": "yes"}, "do_remote_decode must be true or false"),
        ({"do_remote_decode": True, "do_remote_prefill": True}, "cannot both be true"),
        ({"do_remote_prefill": True}, "remote_block_ids"),
        ({"do_remote_decode": True, "transfer_mode": "push"}, "transfer_mode"),
        ({"do_remote_prefill": True, "remote_block_ids": [[0]], "remote_engine_id": "e", "remote_request_id": "r",
          "remote_host": "h", "remote_port": 1, "remote_num_tokens": 3, "tp_size": 2}, "tp_size"),
        ({"do_remote_prefill": True, "remote_block_ids": [[-1]], "remote_engine_id": "e", "remote_request_id": "r",
          "remote_host": "h", "remote_port": 1, "remote_num_tokens": 3}, "non-negative"),
    ],
)
def test_malformed_kv_transfer_params_are_a_400(servers, params, needle) -> None:  # type: ignore[no-untyped-def]
    r = post(servers["decode"], decode_body([1, 2, 3], params))
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"] and r.json()["error"]["param"] == "kv_transfer_params"


def test_a_server_without_kv_transfer_refuses_the_params(servers) -> None:  # type: ignore[no-untyped-def]
    plain = servers["plain"]
    r = post(plain, decode_body([1, 2, 3], {"do_remote_decode": True}))
    assert r.status_code == 400 and "--kv-transfer nixl" in r.json()["error"]["message"]
    assert httpx.get(plain.url + "/kv/metadata").status_code == 404
    assert post(plain, {**decode_body([1, 2, 3], {"do_remote_decode": False})}).status_code == 200


def test_prefill_leg_in_extra_args_and_n_rules(servers) -> None:  # type: ignore[no-untyped-def]
    p = servers["prefill"]
    body = {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 1, "extra_args": {
        "kv_transfer_params": {"do_remote_decode": True}}}}
    assert set(post(p, body).json()["kv_transfer_params"]) == KV_KEYS
    body["sampling_params"]["n"] = 2
    r = post(p, body)
    assert r.status_code == 400 and "n=1" in r.json()["error"]["message"]


def test_the_ready_banner_says_how_kv_is_handed_off(servers) -> None:  # type: ignore[no-untyped-def]
    engine_id = httpx.get(servers["prefill"].url + "/kv/metadata").json()["engine_id"]
    banner = servers["prefill"].log()
    assert f"kv         nixl, engine {engine_id}" in banner and "on load failure fail" in banner
    assert "on load failure recompute" in servers["narrow"].log()
    assert "kv         none" in servers["plain"].log()
