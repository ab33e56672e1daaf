"""Lab infrastructure shared by the tests and the benchmarks: servers, proxies and fleets on one machine.

Not installed (``pyproject.toml`` lists only the product's packages): it is
imported from the repository root, like ``tests/`` and ``benchmarks/``.
It imports the product (``storage``, ``tasks``, ``flows``, ``deployments``),
never ``tests/`` or ``benchmarks/``, and the product never imports it
(``tests/system/test_layers.py`` enforces both).

    processes       free ports, bounded waits, log tails, clean environments, stopping a process group,
                    CPU/RSS of a process, load average, the machine
    postgres        one fresh PostgreSQL database per run
    prefect_server  ``prefect server start`` (SQLite in its own home, or PostgreSQL) and reading runs back
    s3              moto's S3 server in a subprocess
    s3proxy         a fault-injecting, throttling HTTP proxy for S3 (``python -m testbed.s3proxy``)
    throttle        ``throttled://``: the local disk behind a rate-limited link (an fsspec filesystem)
    api_tap         a counting TCP proxy in front of the Prefect API (HTTP requests, websocket messages)
    nodes           node agents as processes (``python -m testbed.nodes agent`` records stage spans)
    trainer         a synthetic model's launch snapshot and training steps, published in-process
    fleet           a fleet lab (database, server, S3, taps, nodes) and its measured publication waves
"""
