"""Load through the real server (`csmserve bench --serve`, bench/serve_bench.py, bench/soak.py): `csmserve serve`
started (or --url), driven through its public HTTP and WebSocket API by streaming clients in several processes;
what users see: requests/s, time to first audio, per-stream audio rate, playbacks that ran dry. The files:
docs/structure.md."""
