"""The pure domain of OpenRL: wire models, ids, events, state machines and policies.

Nothing here performs I/O. Core imports only the standard library, pydantic and numpy;
`tests/openrl_core/test_purity.py` imports it with every I/O library blocked.
"""
