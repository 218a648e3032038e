"""The scheduler function: places trainer and sampler workers on accelerators and scales them with demand.

`openrl scheduler` runs `controller.Scheduler` in the cluster (one replica); see its
docstring for the reconcile pass. The placement policy and the lifecycle rules it applies
are pure code in `openrl_core.placement` and `openrl_core.workload`.
"""
