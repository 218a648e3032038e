"""Event envelopes: an event rebuilt from the store is the event that was stored."""

from __future__ import annotations

from openrl_core.events import Event, new_event
from openrl_core.events import training as te
from openrl_core.events.lifecycle import RequestCompleted
from openrl_core.params import AdamParams


def test_a_stored_event_rebuilt_without_validation_equals_the_validated_one():
    payload = te.OptimStepRequested(request_id="r1", model_id="m", seq_id=3, adam_params=AdamParams(learning_rate=0.5))
    original = new_event(te.OPTIM_STEP["requested"], payload, tenant="alice", source="/t", key="m", subject="r1")
    fields = {name: getattr(original, name) for name in Event.model_fields}
    rebuilt = Event.stored(**fields)
    assert rebuilt == original == Event(**fields) == Event.model_construct(**fields)
    assert rebuilt.model_dump() == original.model_dump() and rebuilt.model_fields_set == original.model_fields_set
    assert (rebuilt.family, rebuilt.verb, rebuilt.phase) == ("training", "optim_step", "requested")
    done = Event.stored(
        **{
            **fields,
            "type": te.OPTIM_STEP["completed"],
            "data": RequestCompleted(request_id="r1", result={}),
            "lease": 7,
        }
    )
    assert done.phase == "completed" and done.lease == 7 and done != original
