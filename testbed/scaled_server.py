"""Prefect scaled out as Prefect documents for a self-hosted server, on one machine.

``ScaledPrefectServer`` runs ``apis`` API processes (``prefect server start
--no-services``, each on its own loopback port), the background services in
a process of their own (``prefect server services start``: scheduler,
automations' triggers, event persister, task-run recorder, ...), one
PostgreSQL database (``testbed.postgres``) and Redis messaging
(``prefect-redis``: the broker, the cache, causal ordering, lease storage and
the docket, all on one Redis database of the local server, 127.0.0.1:6379,
flushed first). A client attached to any API process sees every other's
events and runs. ``cpu_seconds`` sums the CPU of every process of the
server; ``urls`` are the API processes' URLs.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

from testbed.prefect_server import PREFECT, PrefectServer
from testbed.processes import process_cpu_seconds, quiet_env, stop_group, tail

REDIS_HOST, REDIS_PORT = "127.0.0.1", 6379


def redis_settings(db: int) -> dict[str, str]:
    """The settings that put a Prefect server's messaging, cache, ordering, leases and docket on Redis ``db``."""
    return {
        "PREFECT_MESSAGING_BROKER": "prefect_redis.messaging",
        "PREFECT_MESSAGING_CACHE": "prefect_redis.messaging",
        "PREFECT_SERVER_EVENTS_CAUSAL_ORDERING": "prefect_redis.ordering",
        "PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE": "prefect_redis.lease_storage",
        "PREFECT_REDIS_MESSAGING_HOST": REDIS_HOST,
        "PREFECT_REDIS_MESSAGING_PORT": str(REDIS_PORT),
        "PREFECT_REDIS_MESSAGING_DB": str(db),
        "PREFECT_SERVER_DOCKET_URL": f"redis://{REDIS_HOST}:{REDIS_PORT}/{db}",
    }


def flush_redis(db: int) -> None:
    """Empty Redis database ``db`` (ours for this run: streams and keys of an earlier run would be replayed)."""
    import redis

    redis.Redis(host=REDIS_HOST, port=REDIS_PORT, db=db).flushdb()


class ScaledPrefectServer:
    """``apis`` API processes and one services process on PostgreSQL (``database_url``) and Redis (``redis_db``)."""

    def __init__(self, root: Path, database_url: str, *, apis: int = 2, redis_db: int | None = None):
        self.root = Path(root)
        self.database_url = database_url
        self.redis_db = redis_db if redis_db is not None else 1 + (os.getpid() % 15)
        self.settings = {"PREFECT_SERVER_DATABASE_CONNECTION_URL": database_url, **redis_settings(self.redis_db)}
        self.apis = [PrefectServer(self.root / f"api-{i}", database_url, extra_env=self.settings,
                                   args=("--no-services",)) for i in range(apis)]
        self.services_log = self.root / "services.log"
        self.services: subprocess.Popen | None = None
        self.startup_s: float | None = None

    @property
    def urls(self) -> list[str]:
        return [api.url for api in self.apis]

    @property
    def url(self) -> str:
        return self.apis[0].url

    def start(self, timeout_s: float = 240.0) -> "ScaledPrefectServer":
        started = time.monotonic()
        flush_redis(self.redis_db)
        self.root.mkdir(parents=True, exist_ok=True)
        try:
            self.apis[0].start(timeout_s)  # the first one migrates the database; the others find it done
            for api in self.apis[1:]:
                api.start(timeout_s)
            home = self.root / "services-home"
            home.mkdir(parents=True, exist_ok=True)
            env = quiet_env(PREFECT_HOME=str(home), **self.settings)
            with open(self.services_log, "ab") as log:
                self.services = subprocess.Popen([PREFECT, "server", "services", "start"], env=env, cwd=self.root,
                                                 stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                                 start_new_session=True)
            time.sleep(2.0)
            if self.services.poll() is not None:
                raise RuntimeError(f"the Prefect services exited with {self.services.returncode}\n"
                                   f"{tail(self.services_log)}")
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - started
        return self

    def stop(self) -> None:
        stop_group(self.services)
        for api in self.apis:
            stop_group(api.proc)

    def cpu_seconds(self) -> float:
        """CPU of every process of the server: the API processes and the services."""
        pids = [api.proc.pid for api in self.apis if api.proc] + ([self.services.pid] if self.services else [])
        return sum(process_cpu_seconds(pid) for pid in pids)

    def client_env(self, home: Path, api_url: str | None = None, **extra: str) -> dict[str, str]:
        return self.apis[0].client_env(home, api_url, **extra)

    def client(self):
        return self.apis[0].client()

    def diagnostics(self) -> str:
        return "\n".join([f"--- {api.log}\n{tail(api.log)}" for api in self.apis]
                         + [f"--- {self.services_log}\n{tail(self.services_log)}"])

    def __enter__(self) -> "ScaledPrefectServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
