"""Response surfaces: one object per response shape (generate in each output mode, chat, completions).

Each owns its opening (:meth:`~.base.Surface.opening`), the chunk of a step (:meth:`~.base.Surface.chunk`,
with the one emptiness rule :meth:`~.base.Surface.carries`), its closing (the usage chunk) and its batch
answer, and reads a local choice state and a decode leg's relayed chunk alike (:mod:`.source`). The
server's stream runner (:func:`pdserve.serve.responses.respond`) and the proxy (:mod:`pdserve.proxy.relay`)
both build their answers here.
"""

from pdserve.output.surfaces.base import Surface
from pdserve.output.surfaces.generate import (
    GENERATE_SURFACES,
    DerenderSurface,
    GenerateSurface,
    TextSurface,
    TokensSurface,
    generate_surface,
)
from pdserve.output.surfaces.openai import ChatSurface, CompletionsSurface
from pdserve.output.surfaces.source import Finished, Relayed, Step

__all__ = [
    "GENERATE_SURFACES", "ChatSurface", "CompletionsSurface", "DerenderSurface", "Finished", "GenerateSurface",
    "Relayed", "Step", "Surface", "TextSurface", "TokensSurface", "generate_surface",
]
