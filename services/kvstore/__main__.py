"""`python -m services.kvstore`: runs the kvstore service."""

from services.common.server import ServiceSpec, run_service
from services.kvstore.config import KVStoreConfig
from services.kvstore.servicer import KVStoreServicer, register


def main() -> None:
    """Starts the kvstore with settings from the environment."""
    config = KVStoreConfig.from_env()
    config.data_dir.mkdir(parents=True, exist_ok=True)
    servicer = KVStoreServicer(config)
    run_service(
        ServiceSpec(
            config=config.server,
            register=lambda server: register(server, servicer),
            on_start=servicer.start,
            on_stop=servicer.stop,
        )
    )


if __name__ == "__main__":
    main()
