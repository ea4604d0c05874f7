"""`csmserve serve`: in one process, as processes (the engine core + API workers), or on Ray Serve."""
from __future__ import annotations

import argparse
import logging

from csmserve.server.flags import configs, lora_adapters


def run_serve(args: argparse.Namespace) -> int:
    if args.ray:
        from csmserve.ray.app import run_ray

        return run_ray(args)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    server_config, engine_config = configs(args)
    adapters = lora_adapters(args)
    from csmserve.voices import open_voice_store

    # a bad --voices-db: one line now, not every worker failing
    with open_voice_store(server_config.voices_db, server_config.voices_db_timeout_s):
        pass
    if server_config.api_workers != 0:  # the engine core in its own process, N API workers beside it
        from csmserve.server.processes import serve_processes

        return serve_processes(args, server_config, engine_config)
    import uvicorn

    from csmserve.server.app import create_app
    from csmserve.server.timeouts import uvicorn_config

    def load():
        from csmserve.api import CSM

        csm = CSM(args.model, device=args.device, dtype=args.dtype, codec=args.codec, codec_dtype=args.codec_dtype,
                  engine=True, engine_config=engine_config, adapters=adapters or None)
        _ = csm.client  # start the engine (and capture graphs), and serve --lora's adapters, before /ready says so
        return csm

    app = create_app(None, server_config, load=load)
    uvicorn.Server(uvicorn_config(app, server_config, log_level=args.log_level.lower())).run()
    return 0
