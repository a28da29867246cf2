"""One intent log on PostgreSQL, shared by two kernels (as by two processes or hosts).

    pip install 'poimen[postgres]'
    python examples/postgres.py postgresql://poimen@db.internal:5432/agents

The first kernel opens the log by URL and makes a call; the second builds its store with its
own pool sizes and retry budget, and finds the call's outcome in the same log
(docs/postgres.md). The schema is created (or migrated) when a store opens.
"""

from __future__ import annotations

import argparse
import uuid

from poimen import Caps, Kernel, ReadOnly, ToolContext
from poimen.store.postgres import PostgresStore


def register_tools(kernel: Kernel) -> None:
    @kernel.tool(id="lookup_order", effects=ReadOnly(), caps=Caps(), timeout=10)
    def lookup_order(ctx: ToolContext, order_id: str) -> dict[str, str]:
        return {"order_id": order_id, "status": "paid"}


def main(url: str) -> None:
    call_id = f"run-{uuid.uuid4().hex[:8]}/step-1"
    kernel = Kernel(url, worker_id="api-1")  # url: "postgresql://poimen@db.internal:5432/agents"
    register_tools(kernel)
    kernel.launch()
    with kernel:
        print(f"api-1 calls: {kernel.call('lookup_order', {'order_id': 'o-17'}, call_id=call_id)}")

    store = PostgresStore(
        url,
        min_size=1,            # connections opened at start
        max_size=8,            # per process; budget max_connections for all your processes
        connect_timeout=5.0,   # seconds, at start and per connection
        retry_for=10.0,        # how long a write is retried while the database is unreachable
        clock_refresh=60.0,    # seconds between measurements of the server clock (see below)
    )
    kernel = Kernel(store, worker_id="api-2")
    register_tools(kernel)
    with kernel:
        print(f"api-2 finds it in the log: {kernel.outcome(call_id)}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("url", help="postgresql://user@host:port/database")
    main(p.parse_args().url)
