"""`python -m services.kvstore`: runs the kvstore service."""

from services.common.server import ServiceSpec, run_service
from services.kvstore.config import KVStoreConfig
from services.kvstore.dir_lock import DataDirLock, DataDirLocked
from services.kvstore.keys import SecretMissing
from services.kvstore.servicer import KVStoreServicer, register
from services.kvstore.store import load_salts


def main() -> None:
    """Starts the kvstore with settings from the environment."""
    config = KVStoreConfig.from_env()
    try:  # before the port is bound: a data dir this process must not serve starts nothing
        dir_lock = DataDirLock.acquire(config.data_dir)
        load_salts(config.store)
    except (DataDirLocked, SecretMissing) as error:  # for the operator to mend: one line, no traceback
        raise SystemExit(f"kvstore: not starting: {error}") from None
    servicer = KVStoreServicer(config, dir_lock)
    run_service(
        ServiceSpec(
            config=config.server,
            register=lambda server: register(server, servicer),
            on_start=servicer.start,
            on_stop=servicer.stop,
            readiness_probe=servicer.readiness_problem,  # Redis down: live, but no traffic
        )
    )


if __name__ == "__main__":
    main()
