"""`ocrq api`: the HTTP api under uvicorn, refused up front where it cannot listen."""

from __future__ import annotations

import os
from typing import Annotated

import typer

from ocrq.cli.app import (
    EXIT_CONFIG,
    EXIT_UNAVAILABLE,
    app,
    err,
    load_settings,
)


@app.command()
def api(
    host: Annotated[str, typer.Option(help="Address to bind; 0.0.0.0 for every interface.")] = (
        "127.0.0.1"
    ),
    port: Annotated[
        int,
        typer.Option(
            help="Port. 8080 here because `vllm serve` takes 8000 on a host that runs both; the "
            "containers of docker-compose.yml and deploy/k8s have their own and serve on 8000."
        ),
    ] = 8080,
    log_level: Annotated[str, typer.Option(help="uvicorn's log level.")] = "info",
) -> None:
    """Serve the HTTP api (extra `api`): submit, look up and wait for jobs over HTTP.

    The same app as `uvicorn ocrq.api.http:app`; it needs OCRQ_API_TOKEN (or
    OCRQ_API_ALLOW_NO_AUTH=true behind an authenticating proxy). Bound to a loopback address,
    its /docs page opens in a browser without the token (only this machine can reach it) unless
    OCRQ_API_DOCS says otherwise; the api itself still needs the token. /view/JOB_ID shows a
    job's lines drawn over its image (the page asks for the token)."""
    import ipaddress

    try:
        import uvicorn
    except ImportError:
        err.print("the api needs its extra: pip install 'ocrq[api]'", markup=False)
        raise typer.Exit(78) from None
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    public_docs = loopback and "OCRQ_API_DOCS" not in os.environ
    if public_docs:
        os.environ["OCRQ_API_DOCS"] = "public"  # before the app module reads its settings
    from ocrq.api.http import auth_problem

    problem = auth_problem(load_settings())
    if problem is not None:  # the app would refuse it at start-up, in a uvicorn traceback
        err.print(f"[red]ocrq api cannot start:[/] {problem}", soft_wrap=True)
        raise typer.Exit(EXIT_CONFIG)
    if public_docs:
        err.print(f"api docs: http://{host}:{port}/docs (open on loopback; OCRQ_API_DOCS=token "
                  "puts them behind the token)")
    refused = _cannot_listen(host, port)
    if refused is not None:
        err.print(f"[red]ocrq api cannot start:[/] {refused}", soft_wrap=True, highlight=False)
        raise typer.Exit(EXIT_UNAVAILABLE)
    err.print(f"results viewer: http://{host}:{port}/view/JOB_ID#token=... (docs/api.md#viewer)")
    try:
        uvicorn.run("ocrq.api.http:app", host=host, port=port, log_level=log_level)
    except SystemExit as exc:
        # uvicorn's start-up failure is exit 3, which ocrq's scripts read as "jobs pending"
        # (a port taken between the look above and the bind, the app's lifespan failing).
        if exc.code == 3:
            raise typer.Exit(EXIT_UNAVAILABLE) from None
        raise


def _cannot_listen(host: str, port: int) -> str | None:
    """Why `host:port` cannot be listened on (the port taken, the address not this host's),
    or None. Asked before uvicorn starts: its own answer is a log line and exit 3."""
    import errno
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        return f"cannot resolve --host {host}: {exc.strerror}"
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            probe.bind(address)
        except OSError as exc:
            taken = exc.errno == errno.EADDRINUSE
            hint = " (another `ocrq api`? pick one with --port)" if taken else ""
            return f"cannot listen on {host}:{port}: {exc.strerror}{hint}"
    return None

