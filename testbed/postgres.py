"""The per-run PostgreSQL database: a fresh database of its own on the local server, dropped after.

``Postgres`` creates it with ``CREATE DATABASE`` through ``psql`` (the local
server on 127.0.0.1:5432, trust auth), gives the URL a Prefect server uses,
and reads its cumulative counters (``pg_stat_database``) for the per-request
costs in docs/fleet.md.
"""

from __future__ import annotations

import re
import subprocess
import uuid


class Postgres:
    """One database of its own on the local PostgreSQL server (trust auth), created and dropped through ``psql``."""

    def __init__(self, name: str | None = None, *, host: str = "127.0.0.1", port: int = 5432,
                 user: str = "postgres"):
        self.name = name or f"refit_fleet_{uuid.uuid4().hex[:10]}"
        if not re.fullmatch(r"[a-z_][a-z0-9_]{0,62}", self.name):
            raise ValueError(f"database name {self.name!r} is not a plain identifier")
        self.host, self.port, self.user = host, port, user
        self.created = False

    @property
    def url(self) -> str:
        return f"postgresql+asyncpg://{self.user}@{self.host}:{self.port}/{self.name}"

    def _psql(self, sql: str) -> str:
        done = subprocess.run(["psql", "-h", self.host, "-p", str(self.port), "-U", self.user, "-d", "postgres",
                               "-v", "ON_ERROR_STOP=1", "-Atqc", sql], capture_output=True, text=True, timeout=60)
        if done.returncode != 0:
            raise RuntimeError(f"psql {sql!r}: {done.stderr.strip()}")
        return done.stdout

    def create(self, template: str | None = None) -> "Postgres":
        """``CREATE DATABASE``, empty or (``template``) a copy of that database."""
        if template is not None and not re.fullmatch(r"[a-z_][a-z0-9_]{0,62}", template):
            raise ValueError(f"template name {template!r} is not a plain identifier")
        self._psql(f"CREATE DATABASE {self.name}" + (f" TEMPLATE {template}" if template else ""))
        self.created = True
        return self

    def exists(self) -> bool:
        return self._psql(f"SELECT 1 FROM pg_database WHERE datname = '{self.name}'").strip() == "1"

    def seal(self) -> None:
        """No connections to it any more: a template only (as ``template0``), which nothing changes by accident."""
        self._psql(f"ALTER DATABASE {self.name} WITH ALLOW_CONNECTIONS false")

    def rename(self, name: str) -> None:
        if not re.fullmatch(r"[a-z_][a-z0-9_]{0,62}", name):
            raise ValueError(f"database name {name!r} is not a plain identifier")
        self._psql(f"ALTER DATABASE {self.name} RENAME TO {name}")
        self.name = name

    def drop(self) -> None:
        if self.created:
            self._psql(f"DROP DATABASE IF EXISTS {self.name} WITH (FORCE)")
            self.created = False

    def stats(self) -> dict[str, float]:
        """This database's cumulative counters (``pg_stat_database``): seconds spent executing statements,
        transactions committed, rows inserted and updated."""
        out = self._psql("SELECT active_time, xact_commit, tup_inserted, tup_updated FROM pg_stat_database "
                         f"WHERE datname = '{self.name}'").strip()
        active, commits, inserted, updated = (float(x or 0) for x in out.split("|"))
        return {"active_s": active / 1000, "commits": commits, "rows_inserted": inserted, "rows_updated": updated}

    def cpu_seconds(self) -> float:
        """Seconds the database spent executing this database's statements (``active_time``: its CPU and I/O
        together, whichever connection ran them)."""
        return self.stats()["active_s"]

    def __enter__(self) -> "Postgres":
        return self.create()

    def __exit__(self, *exc) -> None:
        self.drop()
