"""`openrl serve`: every function in one process over the embedded log and SQLite store.

The gateway answers HTTP on the event loop; the projector, the trainer and the sampler each
run their consume loop in a thread (torch releases the GIL in its kernels). Trainer and
sampler take turns on the accelerator. Shutdown stops the loops, then closes the log.
"""

from __future__ import annotations

import logging
import threading

import uvicorn

from eventing.projector import Projector
from functions.compute.accelerator import AcceleratorTurns
from functions.gateway.app import create_app
from functions.gateway.routes.checkpoints import Reaper
from functions.runtime import Runtime
from functions.sampler.worker import SamplerWorker
from functions.trainer.worker import TrainerWorker
from openrl_core.settings import Settings

log = logging.getLogger("openrl.serve")


class EmbeddedServer:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.runtime = Runtime(settings)
        for files in self.runtime.models.prepare_all():
            log.info("model %s ready at %s", files.name, files.path)
        self.ctx = self.runtime.gateway_context()
        self.app = create_app(self.ctx)
        rt = self.runtime
        turns = AcceleratorTurns()
        self.projector = Projector(rt.bus, rt.store, rt.notifier)
        self.trainer = TrainerWorker(rt.bus, rt.publisher, rt.blobs, rt.models, turns, settings.device)
        self.sampler = SamplerWorker(
            rt.bus, rt.publisher, rt.blobs, rt.models, turns, settings.device, settings.sampler_max_batch_rows, settings.sampler_max_adapters
        )
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=loop.run, args=(self._stop,), name=name, daemon=True)
            for name, loop in (("projector", self.projector), ("trainer", self.trainer), ("sampler", self.sampler))
        ]
        # Checkpoint TTLs: expired records and the blobs only they used are removed periodically.
        self.reaper = Reaper(self.ctx, settings.checkpoint_reaper_seconds)
        self._threads.append(threading.Thread(target=self.reaper.run, args=(self._stop,), name="reaper", daemon=True))

    def start_workers(self) -> None:
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=30)
        self.runtime.close()

    def serve_forever(self) -> None:
        self.start_workers()
        config = uvicorn.Config(
            self.app, host=self.settings.host, port=self.settings.port, log_level="warning", timeout_keep_alive=75
        )
        try:
            uvicorn.Server(config).run()
        finally:
            self.stop()
