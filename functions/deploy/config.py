"""What `openrl deploy` is asked to deploy, checked before anything is rendered or applied.

Every refusal is a `DeployConfigError` that names the bad value and what would be accepted:
an unknown base model (the catalogue's names, local models and aliases are accepted), a
missing image, an overlay that does not exist or a combination that makes no sense, a
namespace or tenant that is not a Kubernetes / OpenRL name.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

from pydantic import BaseModel, ConfigDict, Field

from functions.deploy.errors import DeployConfigError
from openrl_core.catalog import TINY_QWEN3, Catalog
from openrl_core.errors import InvalidRequest
from openrl_core.ids import check_tenant_name
from openrl_core.placement import POLICIES
from openrl_core.settings import Settings

KNATIVE = Path(__file__).resolve().parents[2] / "knative"
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
# Overlays that stand alone, and the add-ons that go on top of one.
STANDALONE = ("single-node", "distributed", "gpu")
ADD_ONS = {"topics": ("distributed", "gpu")}


class DeployConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    image: str = Field(description="the OpenRL container image (Containerfile), e.g. registry.example/openrl:0.1.0")
    namespace: str = "openrl"
    base_models: list[str] = Field(default_factory=lambda: [TINY_QWEN3])
    overlays: list[str] = Field(default_factory=lambda: ["distributed"])
    tenants: list[str] = Field(default_factory=list)
    kafka_bootstrap: str = "kafka-kafka-bootstrap.kafka:9092"
    kafka_cluster: str = "kafka"
    external_database: bool = False
    scheduler_policy: str = "binpack"
    partitions: int = Field(4, ge=1, le=64)
    manifests: Path = KNATIVE

    @property
    def distributed(self) -> bool:
        return "single-node" not in self.overlays


def checked(
    *,
    image: Optional[str],
    namespace: str = "openrl",
    base_models: Optional[list[str]] = None,
    overlays: Optional[list[str]] = None,
    tenants: Optional[list[str]] = None,
    settings: Optional[Settings] = None,
    **rest,
) -> DeployConfig:
    """A DeployConfig from command-line values, or a DeployConfigError naming what is wrong."""
    settings = settings or Settings()
    if not image or not image.strip():
        raise DeployConfigError("no container image: pass --image REGISTRY/openrl:TAG (build it from Containerfile)")
    if not DNS_LABEL.fullmatch(namespace):
        raise DeployConfigError(f"namespace {namespace!r} is not a Kubernetes name (lower-case letters, digits, '-')")
    catalog = Catalog.from_names(None, settings.local_models, settings.model_aliases)
    models = list(dict.fromkeys(base_models or [TINY_QWEN3]))
    unknown = [m for m in models if m not in catalog.names()]
    if unknown:
        raise DeployConfigError(f"unknown base model(s) {unknown}; this build serves: {', '.join(catalog.names())}")
    root = Path(rest.pop("manifests", None) or KNATIVE)
    available = (
        sorted(p.name for p in (root / "overlays").iterdir() if p.is_dir()) if (root / "overlays").is_dir() else []
    )
    if not available:
        raise DeployConfigError(
            f"no overlays under {root / 'overlays'}: pass --manifests with the repository's knative/"
        )
    chosen = list(dict.fromkeys(overlays or ["distributed"]))
    missing = [o for o in chosen if o not in available]
    if missing:
        raise DeployConfigError(f"overlay(s) {missing} do not exist; choose from {', '.join(available)}")
    bases = [o for o in chosen if o in STANDALONE]
    if len(bases) != 1:
        raise DeployConfigError(f"choose exactly one of {', '.join(STANDALONE)} (given: {', '.join(bases) or 'none'})")
    for add_on, needs in ADD_ONS.items():
        if add_on in chosen and bases[0] not in needs:
            raise DeployConfigError(f"overlay {add_on!r} goes with {' or '.join(needs)}, not {bases[0]!r}")
    names = tenants or sorted(set(settings.tenant_keys().values()))
    try:
        names = [check_tenant_name(t) for t in names]
    except InvalidRequest as exc:
        raise DeployConfigError(exc.detail) from None
    policy = rest.get("scheduler_policy", "binpack")
    if policy not in POLICIES:
        raise DeployConfigError(f"unknown scheduler policy {policy!r}; choose one of {', '.join(POLICIES)}")
    return DeployConfig(
        image=image.strip(), namespace=namespace, base_models=models, overlays=chosen, tenants=names,
        manifests=root, partitions=settings.log_partitions, **{k: v for k, v in rest.items() if v is not None},
    )  # fmt: skip
