"""`python -m services.gateway`: runs the gateway."""

from __future__ import annotations

from services.common.server import ServiceSpec, run_service
from services.gateway.config import GatewayConfig
from services.gateway.gateway import Gateway


def main() -> None:
    """Starts the gateway with settings from the environment."""
    config = GatewayConfig.from_env()
    built: list[Gateway] = []

    def register(server: object) -> list[str]:
        gateway = Gateway(config)  # built inside the server's event loop
        built.append(gateway)
        return gateway.register(server)  # type: ignore[arg-type]

    async def start() -> None:
        await built[0].start()

    async def stop() -> None:
        await built[0].close()

    async def cut_streams() -> None:
        built[0].servicer.in_flight.cut_all()

    spec = ServiceSpec(
        config=config.server, register=register, on_start=start, on_stop=stop, on_grace_over=cut_streams
    )
    run_service(spec)


if __name__ == "__main__":
    main()
