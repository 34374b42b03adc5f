"""The core-to-client output stream: frames survive any split of the byte stream, a client that stops
reading never blocks the core (its messages wait, in order), and either end going away is seen."""

from __future__ import annotations

import socket

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdserve.engine.output_stream import (
    READ_CHUNK_BYTES,
    FrameReader,
    FrameWriter,
    OutputStreamClosed,
    frame,
    listening_socket,
)


def read_in_pieces(data: bytes, cuts: list[int]) -> list[bytes]:
    """The frames a reader gets when ``data`` arrives on its socket in pieces of the ``cuts``' sizes (the rest
    last), read after each piece."""
    writer, sock = socket.socketpair()
    sock.setblocking(False)
    reader, got, at = FrameReader(), [], 0
    for cut in [*cuts, len(data)]:
        writer.sendall(data[at : at + cut])
        at += cut
        got += read_all(reader, sock)
    writer.close()
    sock.close()
    return got


@given(
    payloads=st.lists(st.binary(max_size=3000), max_size=20),
    cuts=st.lists(st.integers(min_value=1, max_value=5000), max_size=40),
)
def test_frames_come_back_whole_and_in_order_for_any_split_of_the_stream(payloads, cuts) -> None:  # type: ignore[no-untyped-def]
    assert read_in_pieces(b"".join(frame(p) for p in payloads), cuts) == payloads


def test_a_frame_longer_than_the_read_buffer_arrives_whole() -> None:
    big = bytes(range(256)) * (3 * READ_CHUNK_BYTES // 256 + 7)
    data = frame(b"small") + frame(big) + frame(b"after")
    assert read_in_pieces(data, [100_000] * (len(data) // 100_000)) == [b"small", big, b"after"]


def connected_pair() -> tuple[FrameWriter, socket.socket]:
    listener, name = listening_socket()
    writer = FrameWriter(name)
    listener.setblocking(True)
    client, _ = listener.accept()
    listener.close()
    client.setblocking(False)
    return writer, client


def read_all(reader: FrameReader, client: socket.socket) -> list[bytes]:
    got = []
    while batch := reader.read_from(client):
        got += batch
    return got


def test_a_client_that_stops_reading_never_blocks_the_core_and_loses_nothing() -> None:
    writer, client = connected_pair()
    payloads = [i.to_bytes(4, "little") * 4096 for i in range(600)]  # ~10 MiB: past every kernel buffer
    for payload in payloads:
        writer.send(payload)  # never blocks
    assert writer.backlog > 0
    reader, got = FrameReader(), []
    while writer.backlog or len(got) < len(payloads):
        got += read_all(reader, client)
        writer.flush()
    assert got == payloads
    writer.close()
    client.close()


def test_the_end_of_either_side_is_seen() -> None:
    writer, client = connected_pair()
    writer.send(b"last words")
    writer.close()
    reader = FrameReader()
    assert reader.read_from(client) == [b"last words"]
    with pytest.raises(OutputStreamClosed):
        reader.read_from(client)
    client.close()

    writer, client = connected_pair()
    client.close()
    with pytest.raises(OutputStreamClosed):
        for _ in range(100):  # the first write after the close may still be taken
            writer.send(b"x" * 65536)
    writer.close()


def test_a_name_nobody_listens_on_is_a_clear_error() -> None:
    listener, name = listening_socket()
    listener.close()
    with pytest.raises(OutputStreamClosed, match="cannot connect"):
        FrameWriter(name)
