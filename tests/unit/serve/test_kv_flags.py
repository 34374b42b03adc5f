"""The KV hand-off flags of ``pdserve serve``: what they put in the engine spec, and the combinations
that are refused at start (never accepted and ignored)."""

from __future__ import annotations

import pytest

from pdserve.cli import build_parser
from pdserve.serve.cli import serve_config


def config(*flags: str):  # type: ignore[no-untyped-def]
    return serve_config(build_parser().parse_args(["serve", *flags]))


def test_the_role_and_side_channel_reach_the_spec() -> None:
    kv = config("--kv-transfer", "nixl", "--kv-role", "decode", "--kv-host", "10.0.0.5").engine.kv_transfer
    assert (kv.role, kv.host, kv.side_channel_port) == ("decode", "10.0.0.5", None)
    assert config("--kv-transfer", "nixl").engine.kv_transfer.role == "both"


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (("--kv-role", "prefill"), "add --kv-transfer nixl"),
        (("--kv-side-channel-port", "5601"), "add --kv-transfer nixl"),
        (("--kv-transfer", "nixl", "--kv-side-channel-port", "5601"), "needs --engine vllm"),
        (("--kv-transfer", "nixl", "--kv-side-channel-port", "0"), "TCP port"),
    ],
)
def test_kv_flags_that_would_be_ignored_are_refused(flags: tuple[str, ...], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        config(*flags)


def test_an_unknown_role_is_an_argparse_error() -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--kv-role", "middle"])
