"""The CloudEvent catalogue: one module per event family, one registry of type → payload.

Type strings read `ai.openrl.<family>.<verb>.<phase>.v1`. Importing this package registers
every family, so `payload_model(type)` knows them all.
"""

from openrl_core.events import access, checkpoints, lifecycle, recovery, sampling, sessions, training  # noqa: F401  (registers)
from openrl_core.events.base import Event, event_type, new_event, payload_model, registered_types

__all__ = ["Event", "event_type", "new_event", "payload_model", "registered_types"]
