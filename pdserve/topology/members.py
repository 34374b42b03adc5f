"""One member of a local topology: what to start (:class:`MemberSpec`) and its process, a
:class:`~pdserve.topology.process.ServerProcess` with its log in the topology's log directory."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pdserve.topology.process import ServerProcess


@dataclass(frozen=True)
class MemberSpec:
    """What to start: a name (``prefill-0``), its role, the ``pdserve`` arguments and its port."""

    name: str
    role: str  # render | prefill | decode | proxy
    args: tuple[str, ...]  # they name the host and port (``plan`` puts them in)
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def member_process(spec: MemberSpec, log_dir: Path) -> ServerProcess:
    """The member's process (not started), logging to ``log_dir/<name>.log``."""
    return ServerProcess(spec.name, spec.args, port=spec.port, address=False, log_path=log_dir / f"{spec.name}.log")
