"""Deploying OpenRL on Kubernetes with Knative: manifest rendering and the API clients.

`config` checks what is asked for, `kustomize` + `render` turn knative/ into concrete
manifests, `kube` is the Kubernetes API (a protocol and its implementation over the
official client), `knative` the Knative Serving client, `apply` applies, reports and
removes, `workers` stamps worker StatefulSets for the scheduler, `cli` the commands.
"""
