"""OpenRL functions: thin handlers over `openrl_core` and `eventing`, one per concern.

`functions.compute` is the one shared library here: the torch code that both the trainer
and the sampler need (model materialisation and loading). No function imports another
function's modules.
"""
