"""`python -m services.gateway`: runs the gateway."""

from __future__ import annotations

import grpc

from services.common.server import ServiceSpec, run_service
from services.gateway.config import GatewayConfig
from services.gateway.servicer import register
from services.gateway.upstream import Upstreams


def main() -> None:
    """Starts the gateway with settings from the environment."""
    config = GatewayConfig.from_env()
    opened: list[Upstreams] = []

    def register_all(server: grpc.aio.Server) -> list[str]:
        names, upstreams = register(server, config)
        opened.append(upstreams)
        return names

    async def close_upstreams() -> None:
        for upstreams in opened:
            await upstreams.close()

    run_service(ServiceSpec(config=config.server, register=register_all, on_stop=close_upstreams))


if __name__ == "__main__":
    main()
