"""Admission of kv_transfer_params: which legs a server takes (--kv-role), and whose keys a decode leg's
pull reads (pdserve's own hand-off parses them; vLLM's NixlConnector reads them itself)."""

from __future__ import annotations

import msgspec
import pytest

from pdserve.protocol.engine import EngineInfo
from pdserve.protocol.errors import RequestError
from pdserve.protocol.generate import GenerateRequest
from pdserve.protocol.kv import KVAgentInfo, KVLayout, parse_kv_transfer_params
from pdserve.serve.admission import admit
from tests.unit.serve.test_sampling_to_engine import INFO, state

# What vLLM 0.32's NixlConnector returns from a prefill leg (reference/vllm-peer.md): no remote_num_tokens,
# and remote_port is its NIXL side channel.
VLLM_PREFILL_OUT = {
    "do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[1]], "remote_engine_id": "e1",
    "remote_request_id": "cmpl-1", "remote_host": "localhost", "remote_port": 5601, "tp_size": 1, "dcp_size": 1,
}
PDSERVE_AGENT = KVAgentInfo(
    engine_id="pd", backend="nixl", agent_metadata=b"", base_address=0, num_slots=2, slot_positions=64,
    layout=KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, block_size=16, dtype="float32", itemsize=4),
)


def info(**kv: object) -> EngineInfo:
    return msgspec.structs.replace(INFO, **kv)


def leg(params: dict[str, object], **sampling: object) -> GenerateRequest:
    return GenerateRequest.model_validate(
        {"token_ids": [9707, 11], "sampling_params": {"max_tokens": 1, **sampling}, "kv_transfer_params": params}
    )


def test_vllm_connector_params_go_to_vllm_unparsed() -> None:
    intent = parse_kv_transfer_params(VLLM_PREFILL_OUT, pulls=False)
    assert intent.remote_prefill and intent.pull is None and intent.any
    with pytest.raises(RequestError, match="remote_num_tokens"):
        parse_kv_transfer_params(VLLM_PREFILL_OUT)  # pdserve's own pull needs it
    admitted = admit(state(info=info(kv_connector="NixlConnector")), leg(VLLM_PREFILL_OUT), "r")
    assert admitted.engine_request.kv_transfer_params == VLLM_PREFILL_OUT
    assert admitted.kv.remote_prefill


def test_the_leg_checks_hold_for_the_vllm_connector_too() -> None:
    with pytest.raises(RequestError, match="both be true"):
        parse_kv_transfer_params({"do_remote_decode": True, "do_remote_prefill": True}, pulls=False)
    vllm = state(info=info(kv_connector="NixlConnector"))
    with pytest.raises(RequestError, match="n=1"):
        admit(vllm, leg({"do_remote_decode": True}, n=2), "r")
    with pytest.raises(RequestError, match="prompt_logprobs") as err:
        admit(vllm, leg(VLLM_PREFILL_OUT, prompt_logprobs=1), "r")
    assert err.value.param == "sampling_params.prompt_logprobs"


@pytest.mark.parametrize("connector", [{"kv_connector": "NixlConnector"}, {"kv": PDSERVE_AGENT}])
def test_a_leg_of_the_other_pool_is_a_400_naming_the_role(connector: dict[str, object]) -> None:
    prefill_only, decode_only = state(info=info(kv_role="prefill", **connector)), state(info=info(kv_role="decode", **connector))
    decode_leg = {**VLLM_PREFILL_OUT, "remote_num_tokens": 2}  # pdserve's own prefill params carry it too
    assert admit(prefill_only, leg({"do_remote_decode": True}), "r").kv.export
    assert admit(decode_only, leg(decode_leg), "r").kv.remote_prefill
    with pytest.raises(RequestError, match="takes prefill legs only") as err:
        admit(prefill_only, leg(decode_leg), "r")
    assert err.value.param == "kv_transfer_params" and "--kv-role prefill" in err.value.message
    with pytest.raises(RequestError, match="takes decode legs only"):
        admit(decode_only, leg({"do_remote_decode": True}), "r")
    # A request without KV params is served by either pool (vLLM's producer and consumer serve it too).
    assert not admit(prefill_only, leg({}), "r").kv.any and not admit(decode_only, leg({}), "r").kv.any


def test_without_a_kv_hand_off_the_params_are_refused() -> None:
    with pytest.raises(RequestError, match="without --kv-transfer nixl"):
        admit(state(), leg({"do_remote_decode": True}), "r")
