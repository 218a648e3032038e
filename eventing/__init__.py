"""Event plumbing: the CloudEvents codec, the EventBus and its backends, the event store,
its projections, the projector and replay. Imports `openrl_core`, never `functions`.
"""
