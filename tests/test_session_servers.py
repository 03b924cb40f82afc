"""The suite's own servers: a developer's PostgreSQL and Redis are never what it writes to."""

from __future__ import annotations

from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from tests import conftest


def test_the_session_database_server_is_its_own(database_url: str, broker_url: str) -> None:
    """Unless OCRQ_TEST_PG_URL names a server, the session started one on a free port: the
    migrated test database lives there, and the machine's server on 5432 is not touched."""
    if not conftest._PRIVATE_PG:  # a server was named: it is used as given
        assert make_url(database_url).port == make_url(conftest.TEST_PG).port
        return
    server = conftest._PRIVATE_PG[0]
    port = make_url(database_url).port
    assert port == server.port != 5432  # type: ignore[attr-defined]
    admin = create_engine(conftest.TEST_PG, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            names = conn.execute(text("SELECT datname FROM pg_database")).scalars().all()
    finally:
        admin.dispose()
    assert make_url(database_url).database in names
    assert set(names) - {"postgres", "template0", "template1"} <= {
        n for n in names if n.startswith("ocrq_")
    }
    assert make_url(broker_url).port != 6379
