"""An alias shares its target's files on disk and its engine (base weights) in each worker."""

from __future__ import annotations

from eventing.blobs import BlobStore
from eventing.bus import EventPublisher
from eventing.codec import Codec
from eventing.embedded_log import EmbeddedLog
from functions.compute.models import ModelDirectory
from functions.sampler.worker import SamplerWorker
from functions.trainer.worker import TrainerWorker
from openrl_core.catalog import TINY_QWEN3, Catalog

ALIAS = "Qwen/Qwen3-8B"


def test_an_alias_shares_files_and_engines(tmp_path, tiny_files):
    models = ModelDirectory(Catalog.from_names([TINY_QWEN3], aliases={ALIAS: TINY_QWEN3}))
    assert models.files(ALIAS) is models.files(TINY_QWEN3)
    assert models.files(ALIAS).path == tiny_files.path and models.files(ALIAS).name == TINY_QWEN3
    log = EmbeddedLog(tmp_path / "log.db")
    codec = Codec(BlobStore(tmp_path / "blobs"))
    publisher = EventPublisher(log, codec)
    try:
        for worker in (
            TrainerWorker(log, publisher, codec.blobs, models),
            SamplerWorker(log, publisher, codec.blobs, models),
        ):
            assert worker.engine(ALIAS) is worker.engine(TINY_QWEN3)
    finally:
        log.close()
