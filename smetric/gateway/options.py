"""What ``smetric pick`` runs with: ``smetric serve``'s config, with the picker's ports."""

from __future__ import annotations

from dataclasses import dataclass, field

from smetric.core.settings import setting
from smetric.serve.config import ColocatedConfig, FrontDoor


@dataclass
class PickOptions(FrontDoor):
    """The ``router:`` section of ``smetric pick --config``."""

    port: int = setting(9002, "gRPC port: ext_proc and health (0: any free port).", ge=0, le=65535)
    metrics_port: int = setting(
        9090, "HTTP port of /metrics, /health and /live (0: any free port).", ge=0, le=65535
    )
    max_inflight: int = setting(
        0,
        "Answer 429 when every engine a request may go to has this many requests in "
        "flight (0: never shed).",
        ge=0,
    )


@dataclass(frozen=True)
class PickConfig(ColocatedConfig):
    """A ``smetric pick --config`` file."""

    router: PickOptions = field(default_factory=PickOptions)
