"""The blob collector: deletes stored blobs that no record needs any more (see `collector`)."""

from functions.collector.collector import BlobCollector, CollectorLoop, Pass

__all__ = ["BlobCollector", "CollectorLoop", "Pass"]
