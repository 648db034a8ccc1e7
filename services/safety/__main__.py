"""`python -m services.safety`: runs the safety service."""

from services.common.server import ServiceSpec, run_service
from services.safety.config import SafetyConfig
from services.safety.servicer import register


def main() -> None:
    """Starts the safety service with settings from the environment."""
    config = SafetyConfig.from_env()
    run_service(ServiceSpec(config=config.server, register=lambda server: register(server, config)))


if __name__ == "__main__":
    main()
