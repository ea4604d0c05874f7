"""Load through the real server (`csmserve bench --serve`, `python bench/serve_bench.py`, `bench/soak.py`): it
starts `csmserve serve` (or targets --url), drives it through its public API only, HTTP and WebSocket, with
real streaming clients in several processes, and prints what users see: requests/s, time to first audio,
per-stream audio rate, and how many streams' playback ran dry.

    bench.py         flags, the client processes, each scenario, the table and files; several setups side by side
    client.py        a client process: an asyncio loop of many users, JSON lines to the parent
    users.py         scenarios, the HTTP and WebSocket users, a record per request or turn, the jitter buffer
                     that says whether a stream ran dry
    meters.py        seconds of audio received, from each format's framing (no decoding)
    report.py        records and the server's /metrics -> numbers -> the markdown table
    server.py        `csmserve serve` as a subprocess, readiness, benchmark voices; its processes' CPU and memory
    soak.py          the soak: many users for minutes; crashes, 5xx, slots, memory, TTFA over time
    soak_users.py    the soak's users: disconnects, hostile requests, conversations, voice churn
    hostile.py       the soak's hostile requests, each with the answer it must get
    trace_report.py  `--trace-requests` files joined: where each request's time to first audio went
"""
